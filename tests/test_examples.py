"""Every example runs exactly as docs/quick_tour.md says: the commands of its table, run as written, and prints no
Python or torch warning (a warning the user cannot act on is fixed, or filtered in the example with its reason).

The commands are read from the table's last column and run with this venv's ``hasten`` or ``accelerate`` command,
from a scratch folder in which ``examples`` is the repository's (so the folders they write stay there). The one
thing added is a default config file in ``HASTEN_HOME`` naming a free rendezvous port, as ``hasten config`` would
give a machine: other jobs on the machine may hold the default port.
"""

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, clean_env, free_port, requires

EXAMPLES = ROOT / "examples"
QUICK_TOUR = ROOT / "docs" / "quick_tour.md"
# Generous: other jobs may share the two cores, and DeepSpeed may first have to compile its CPU ops.
TIMEOUT = 600


def documented_commands() -> dict[str, list[str]]:
    """Example file -> the commands of its row of the quick tour's table, in order."""
    rows = {}
    for line in QUICK_TOUR.read_text().splitlines():
        match = re.match(r"\| \[`(\w+\.py)`\]", line)
        if match:
            rows[match.group(1)] = [
                c for c in re.findall(r"`([^`]+)`", line.split(" | ")[-1]) if c.startswith(("hasten ", "accelerate "))
            ]
    return rows


def run_documented(example: str, workdir: Path) -> list[subprocess.CompletedProcess]:
    """Run the documented commands of ``example`` one after the other in ``workdir``; fail with the output of one
    that fails."""
    (workdir / "examples").symlink_to(EXAMPLES)
    (workdir / "home").mkdir()
    (workdir / "home" / "default_config.yaml").write_text(f"main_process_port: {free_port()}\n")
    env = clean_env(HASTEN_HOME=str(workdir / "home"))
    runs = []
    for command in documented_commands()[example]:
        program, *args = shlex.split(command)
        executable = Path(sys.executable).parent / program
        assert executable.exists(), f"`{program}` is not in this venv: the test must require what installs it"
        proc = subprocess.run(
            [str(executable), *args], env=env, cwd=workdir, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"`{command}` failed ({proc.returncode}):\n"
                f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
            )
        noise = [line for line in proc.stderr.splitlines() if "Warning: " in line]
        assert not noise, f"`{command}` printed warnings (an example prints none a user cannot act on):\n" + "\n".join(
            noise
        )
        runs.append(proc)
    return runs


def _bar_ends(stderr: str, description: str) -> list[str]:
    """The last lines of the progress bars called ``description`` (in a log, each bar writes its end as a line)."""
    return re.findall(rf"^{re.escape(description)}: 100%\|.*$", stderr, re.MULTILINE)


def _numbers(pattern: str, text: str) -> dict[int, float]:
    """``{int(group 1): float(group 2)}`` for every match of ``pattern``."""
    return {int(step): float(value) for step, value in re.findall(pattern, text)}


def test_the_quick_tour_documents_how_to_run_every_example():
    commands = documented_commands()
    assert sorted(commands) == sorted(p.name for p in EXAMPLES.glob("*.py"))
    for example, documented in commands.items():
        assert documented and all(f"examples/{example}" in command for command in documented), (example, documented)


@pytest.mark.slow
def test_digits_classifier_shows_each_bar_once(tmp_path):
    (proc,) = run_documented("digits_classifier.py", tmp_path)
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+) on 360 samples", proc.stdout)]
    assert len(accuracies) == 10, proc.stdout
    assert accuracies[-1] > 0.85, accuracies
    assert [len(_bar_ends(proc.stderr, f"epoch {epoch}")) for epoch in range(10)] == [1] * 10, proc.stderr[-3000:]
    assert "0/23" not in proc.stderr and "\r" not in proc.stderr


@pytest.mark.slow
def test_language_model_reaches_its_loss_and_resumes_where_it_stopped(tmp_path):
    from helpers import read_scalars

    first, second = run_documented("language_model.py", tmp_path)
    run = tmp_path / "runs" / "language_model"
    losses = _numbers(r"step (\d+): loss ([0-9.]+)", first.stdout)
    assert sorted(losses) == list(range(10, 101, 10)), first.stdout
    held_out = _numbers(r"step (\d+): held-out loss ([0-9.]+) \(perplexity [0-9.]+\) on 249 sequences", first.stdout)
    assert sorted(held_out) == [50, 100], first.stdout  # 249: every held-out sequence once, none padded in
    assert held_out[100] < 2.75, held_out  # the threshold stated in the example's docstring
    assert losses[100] < losses[10] - 1.5, losses
    # One progress bar per machine, not one per process.
    assert len(_bar_ends(first.stderr, "training")) == 1, first.stderr[-3000:]
    assert len(_bar_ends(first.stderr, "evaluating")) == 2, first.stderr[-3000:]

    assert (
        f"resumed from {Path('runs') / 'language_model' / 'checkpoints' / 'checkpoint_1'} at step 100" in second.stdout
    ), second.stdout
    resumed = _numbers(r"step (\d+): loss ([0-9.]+)", second.stdout)
    assert sorted(resumed) == [110, 120, 130, 140, 150], second.stdout
    assert abs(resumed[110] - losses[100]) < 0.25 and resumed[150] < losses[50], (losses, resumed)
    (resumed_bar,) = _bar_ends(second.stderr, "training")
    assert "| 150/150 [" in resumed_bar, second.stderr[-3000:]  # from step 100: 50 updates reach 150
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]

    scalars = read_scalars(run / "language_model")
    train_steps = sorted(step for tag, step, _ in scalars if tag == "train/loss")
    assert train_steps == list(range(10, 151, 10)), train_steps
    assert sorted(step for tag, step, _ in scalars if tag == "eval/perplexity") == [50, 100, 150]


@pytest.mark.slow
def test_find_batch_size_halves_until_the_batch_fits(tmp_path):
    (proc,) = run_documented("find_batch_size.py", tmp_path)
    out = proc.stdout
    assert [int(size) for size in re.findall(r"trying batch size (\d+) per process", out)] == [256, 128, 64, 32, 16], (
        out
    )
    match = re.search(r"trained with batch size 16 per process: accuracy ([0-9.]+) on 500 held-out samples", out)
    assert match and float(match.group(1)) > 0.85, out


@pytest.mark.slow
def test_early_stopping_stops_every_rank_at_the_same_step(tmp_path):
    (proc,) = run_documented("early_stopping.py", tmp_path)
    out = proc.stdout
    stops = _numbers(r"rank (\d+): stopped at step (\d+) of 400", out)
    assert sorted(stops) == [0, 1] and stops[0] == stops[1] < 400, out
    asked = _numbers(r"rank (\d+): step (\d+): patience ran out", out)
    assert asked and all(step == stops[0] for step in asked.values()), out
    assert re.search(r"validation loss on all 64 samples: [0-9.]+", out), out


@pytest.mark.slow
@requires("deepspeed")
def test_deepspeed_config_with_auto_values(tmp_path):
    (proc,) = run_documented("deepspeed_config.py", tmp_path)
    out = proc.stdout
    resolved = (
        'DeepSpeed ZeRO-2, resolved config values: {"train_micro_batch_size_per_gpu": 32, "train_batch_size": 128, '
        '"gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "optimizer.params.lr": 0.01, '
        # total_num_steps: 2 epochs x 16 optimizer steps
        '"scheduler.params.warmup_num_steps": 5, "scheduler.params.total_num_steps": 32}'
    )
    assert resolved in out and "distributed type DEEPSPEED, 2 process(es)" in out, out
    accuracies = [float(a) for a in re.findall(r"epoch \d: accuracy ([0-9.]+) on 512 held-out samples", out)]
    assert len(accuracies) == 2 and accuracies[-1] > 0.85, out


def test_transformers_script_differs_from_its_accelerate_version_only_in_imports():
    source = (EXAMPLES / "transformers_no_trainer.py").read_text()
    tree = ast.parse(source)
    hasten_imports = [
        node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "hasten"
    ]
    assert sorted(node.module for node in hasten_imports) == ["hasten", "hasten.logging", "hasten.utils"]
    import_lines = {line for node in hasten_imports for line in range(node.lineno, node.end_lineno + 1)}
    docstring_lines = set(range(tree.body[0].lineno, tree.body[0].end_lineno + 1))
    code = [line for number, line in enumerate(source.splitlines(), 1) if number not in import_lines | docstring_lines]
    assert not [line for line in code if "hasten" in line]


@pytest.mark.slow
@requires("transformers")
def test_transformers_no_trainer_script_trains_checkpoints_and_saves(tmp_path):
    # A plain `hasten launch`: transformers imports peft (installed), which imports accelerate, which is hasten here.
    (proc,) = run_documented("transformers_no_trainer.py", tmp_path)
    out, output_dir = proc.stdout, tmp_path / "runs" / "gpt2_tiny"
    losses = _numbers(r"step (\d+): loss ([0-9.]+)", out)
    assert sorted(losses) == [10, 20, 30, 40] and losses[40] < 3.6, out  # from ln(256) = 5.5 at the start
    # 157 validation blocks: the per-batch losses repeated to the batch size, gathered without the padding.
    eval_loss = re.search(r"epoch 0: eval_loss ([0-9.]+) perplexity [0-9.]+ over 157 values", out)
    assert eval_loss and float(eval_loss.group(1)) < 3.6, out
    expected = {"config.json", "model.safetensors", "all_results.json", "step_20", "step_40", "clm_no_trainer"}
    assert expected <= {p.name for p in output_dir.iterdir()}


@pytest.mark.slow
@requires("transformers", "accelerate command")
def test_transformers_trainer_runs_under_the_accelerate_command_and_resumes(tmp_path):
    first, second = run_documented("transformers_trainer.py", tmp_path)
    assert "Trainer runs on hasten (accelerate 1.15.0), 2 process(es)" in first.stdout, first.stdout[-6000:]
    losses = {int(s): float(v) for s, v in re.findall(r"^step (\d+): loss ([0-9.]+)$", first.stdout, re.MULTILINE)}
    evals = {int(s): float(v) for s, v in re.findall(r"^step (\d+): eval_loss ([0-9.]+)$", first.stdout, re.MULTILINE)}
    assert sorted(losses) == [10, 20, 30, 40] and sorted(evals) == [20, 40], first.stdout[-6000:]
    assert losses[40] < losses[10] - 1.0 and evals[40] < 2.8, (losses, evals)  # from ln(256) = 5.5
    resumed = {int(s) for s in re.findall(r"^step (\d+): loss ", second.stdout, re.MULTILINE)}
    assert resumed == {50, 60} and "resumed, now at step 60" in second.stdout, second.stdout[-6000:]
    assert sorted(p.name for p in (tmp_path / "runs" / "trainer").glob("checkpoint-*")) == [
        "checkpoint-60"
    ]  # save_total_limit=1


@pytest.mark.slow
@requires("transformers")
def test_tp_fsdp_llama_learns_on_four_processes_holding_a_quarter_each(tmp_path):
    (proc,) = run_documented("tp_fsdp_llama.py", tmp_path)
    assert "mesh {'dp_shard': 2, 'tp': 2}" in proc.stdout, proc.stdout
    fractions = [float(f) for f in re.findall(r"holds ([0-9.]+) of the parameter bytes", proc.stdout)]
    assert len(fractions) == 4 and all(0.25 <= f < 0.26 for f in fractions), fractions
    before = float(re.search(r"held-out loss before training ([0-9.]+)", proc.stdout).group(1))
    after = float(re.search(r"held-out loss after 60 steps ([0-9.]+)", proc.stdout).group(1))
    assert before > 5.0 and after < 3.2, (before, after)


@pytest.mark.slow
@requires("transformers")
def test_long_context_splits_each_sequence_over_two_processes(tmp_path):
    (proc,) = run_documented("long_context.py", tmp_path)
    assert "2 processes split each 4096-byte sequence (accelerate Ulysses" in proc.stdout, proc.stdout
    assert proc.stdout.count("on 2048 bytes per process") == 3, proc.stdout
    before = float(re.search(r"held-out loss before training ([0-9.]+)", proc.stdout).group(1))
    after = float(re.search(r"held-out loss after 30 steps ([0-9.]+)", proc.stdout).group(1))
    assert before > 5.0 and after < 3.5, (before, after)
