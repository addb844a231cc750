"""Real clients of Accelerate, run on hasten and on Accelerate 1.15 with the same script and seed, compared.

``tests/scripts/clients/run_clients.py`` runs each client the way its users write it, on tiny models built from
configs in code: transformers' ``Trainer`` (gradient checkpointing, evaluation on an uneven set) and
``Seq2SeqTrainer`` (T5, generation in evaluation), trl's ``SFTTrainer``, a peft LoRA loop, diffusers'
unconditional training pattern (save/load hooks, EMA, save and resume), sentence-transformers'
``SentenceTransformerTrainer`` and setfit. One launch runs every client, on 1 and on 2 processes, once through
``hasten launch --as_accelerate`` and once on the reference copy (``PYTHONPATH`` first; for 2 processes under
``torchrun`` with ``ACCELERATE_USE_CPU=1``: ``accelerate launch --cpu`` starts several CPU processes only through
mpirun). Dropout, shuffling, noise: every random stream is in play, so equal results mean hasten consumed each one
as Accelerate does. The logged numbers (losses, evaluation metrics, predictions) and the final weights must be
equal, bit for bit: the engine is the same (one process, or DDP over gloo). ``DELIBERATE`` lists the differences
kept on purpose (checked to still differ).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
from differential import REFERENCE
from helpers import ROOT, SCRIPTS, clean_env, free_port, requires

SCRIPT = SCRIPTS / "clients" / "run_clients.py"
NEEDS = {
    "trainer": ("transformers",),
    "seq2seq": ("transformers",),
    "trl": ("trl", "datasets"),
    "peft": ("peft", "transformers"),
    "diffusers": ("diffusers",),
    "diffusers_resume": ("diffusers",),
    "sentence_transformers": ("sentence_transformers", "datasets"),
    "setfit": ("setfit", "sklearn"),
}
PROCESSES = (1, 2)
# client -> why hasten's result differs from Accelerate's on purpose (docs/migration.md): checked to still differ
DELIBERATE = {
    "diffusers_resume": "a resumed epoch replays the states its generators started from and draws nothing; "
    "Accelerate's resumed loader draws its epoch's seeds again: on one process torch's base seed (and the shuffling "
    "seed) from the restored global generator, which moves every later draw (the noise); on two, a shuffled epoch "
    "gets another order than the interrupted one had (without shuffling, two processes resume as Accelerate does)",
}


def _missing(part: str) -> list[str]:
    """The packages ``part`` needs that are not installed (found, not imported: they import accelerate)."""
    return [package for package in NEEDS[part] if importlib.util.find_spec(package) is None]


def _command(side: str, processes: int, out) -> tuple[list[str], dict]:
    """The launch of every installed client on ``side`` ("hasten" or "accelerate"), and its environment."""
    parts = [part for part in NEEDS if not _missing(part)]
    if side == "hasten":
        launch = [
            sys.executable,
            "-m",
            "hasten.commands.main",
            "launch",
            "--as_accelerate",
            "--cpu",
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(free_port()),
            "-q",
        ]
        return [*launch, str(SCRIPT), str(out), *parts], clean_env(PYTHONPATH=str(ROOT / "src"))
    if processes == 1:
        return [sys.executable, str(SCRIPT), str(out), *parts], clean_env(PYTHONPATH=str(REFERENCE))
    # Accelerate's launcher starts several CPU processes only through mpirun; under torchrun it needs ACCELERATE_USE_CPU
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    return [*torchrun, str(SCRIPT), str(out), *parts], clean_env(PYTHONPATH=str(REFERENCE), ACCELERATE_USE_CPU="1")


def _run(side: str, processes: int, out, timeout: float = 900) -> str:
    """Run the clients on one side (its own process group, killed whole on timeout); returns the output."""
    cmd, env = _command(side, processes, out)
    with subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += f"\n[killed after {timeout} s]"
    return output


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(processes)``: the output folders of both sides' launches, run once per process count."""
    done = {}

    def run(processes: int) -> dict:
        if processes not in done:
            folders = {}
            for side in ("accelerate", "hasten"):
                out = tmp_path_factory.mktemp(f"clients-{side}-{processes}")
                folders[side] = (out, _run(side, processes, out))
            done[processes] = folders
        return done[processes]

    return run


def _result(out, output: str, part: str, rank: int, side: str) -> dict:
    path = out / f"{part}_rank{rank}.json"
    assert path.is_file(), f"{side}: process {rank} wrote no result for {part}:\n{output[-6000:]}"
    return json.loads(path.read_text())


def _weight_differences(reference_file, hasten_file) -> list[str]:
    import torch
    from safetensors.torch import load_file

    theirs, ours = load_file(str(reference_file)), load_file(str(hasten_file))
    if theirs.keys() != ours.keys():
        only_theirs, only_ours = sorted(theirs.keys() - ours.keys()), sorted(ours.keys() - theirs.keys())
        return [f"keys: only Accelerate {only_theirs[:5]}, only hasten {only_ours[:5]}"]
    return [
        f"{key}: max |diff| {float((theirs[key].double() - ours[key].double()).abs().max()):.3g}"
        for key in theirs
        if not torch.equal(theirs[key], ours[key])
    ]


def _cases():
    for part in (part for part in NEEDS if part not in DELIBERATE):
        for processes in PROCESSES:
            marks = [pytest.mark.slow, requires("reference", *NEEDS[part])]
            yield pytest.param(part, processes, marks=marks, id=f"{part}-{processes}proc")


def _compared(launched, part: str, processes: int) -> tuple[dict, list[str]]:
    """Both sides' results for ``part`` (checked to have run on the right library), and where hasten's differ."""
    sides = launched(processes)
    results = {
        side: [_result(out, output, part, rank, side) for rank in range(processes)]
        for side, (out, output) in sides.items()
    }
    differing = []
    for rank, reference in enumerate(results["accelerate"]):
        assert reference["ok"], (
            f"{part} failed on Accelerate (process {rank}), so there is nothing to compare:\n{reference['error']}"
        )
        ours = results["hasten"][rank]
        assert ours["ok"], f"{part} failed on hasten (process {rank}):\n{ours['error']}"
        assert reference["accelerator"] == "accelerate.accelerator" and ours["accelerator"] == "hasten.accelerator"
        differing += [
            f"process {rank}: {key} {reference['numbers'][key]} != {ours['numbers'].get(key)}"
            for key in reference["numbers"]
            if ours["numbers"].get(key) != reference["numbers"][key]
        ]
    differing += _weight_differences(
        sides["accelerate"][0] / f"{part}.safetensors", sides["hasten"][0] / f"{part}.safetensors"
    )
    return {side: folder for side, (folder, _) in sides.items()}, differing


@pytest.mark.parametrize(("part", "processes"), list(_cases()))
def test_client_gives_accelerates_numbers_and_weights(launched, part, processes):
    _, differing = _compared(launched, part, processes)
    assert not differing, f"{len(differing)} results differ from Accelerate's: {[line[:300] for line in differing[:6]]}"


@pytest.mark.slow
@pytest.mark.parametrize("processes", PROCESSES)
@requires("reference", *NEEDS["diffusers_resume"])
def test_diffusers_resume_differs_from_accelerate_as_documented(launched, processes):
    """hasten's resumed run differs from Accelerate's (DELIBERATE); on one process it is hasten's uninterrupted run."""
    folders, differing = _compared(launched, "diffusers_resume", processes)
    assert differing, "no longer differs from Accelerate: remove diffusers_resume from DELIBERATE and docs/migration.md"
    if processes == 1:  # on two, process 1's random state is not in the main-process-only checkpoint (as in Accelerate)
        import torch
        from safetensors.torch import load_file

        straight, resumed = (
            load_file(str(folders["hasten"] / f"{part}.safetensors")) for part in ("diffusers", "diffusers_resume")
        )
        assert straight.keys() == resumed.keys() and all(torch.equal(straight[key], resumed[key]) for key in straight)
        losses = [
            json.loads((folders["hasten"] / f"{part}_rank0.json").read_text())["numbers"]["losses"]
            for part in ("diffusers", "diffusers_resume")
        ]
        assert losses[0][-len(losses[1]) :] == losses[1]
