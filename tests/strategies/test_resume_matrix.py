"""The resume matrix (issue 32): a checkpoint of any layout resumes under any other (engine_change.py,
strategies/deepspeed/{resharding,other_engines}.py, strategies/fsdp/{checkpoint,other_engines}.py).

Layouts: one process without a wrapper (``single_w1``), DDP on 2 and 4, FSDP2 (sharded state dict) and ZeRO 1, 2 and 3
on 1, 2 and 4 processes. A pair is a source layout and another target layout. ``--all-cases`` runs the whole matrix
(210 pairs); by default a sample generated with a fixed seed holds every (engine from, engine to) kind (one process
counted as DDP) and every layout as a source and as a target at least once, with as few resumes on 4 processes as
that allows (4 processes on 2 cores are slow), and pairs that fit in four launches: a checkpoint resumes on as many
processes as saved it or more, or on one.

tests/scripts/resume_matrix.py runs the plan. From the fewest processes up, one launch per number of processes runs
every layout there without a break, saving its checkpoint on the way (the source of the pairs it is the source of; the
run its targets are compared with), then resumes under its layouts the sources saved so far; a last launch per number
of processes resumes the sources of more processes (in the sample: on one process). After each resume the weights
and Adam's state are the saved ones bit for bit, the samples before and after make the epoch once each, the next
steps' losses, the weights and Adam's state at the end match the target layout's run within 1e-6 relative (bit for
bit where the source has as many processes, one or two: the same arithmetic), and the learning rate is the run's.
Without a launch, on the launches' checkpoints: a corrupt or missing shard of a sharded checkpoint (ZeRO, FSDP2)
resumed under another engine is refused naming the file before anything changes, and so is a checkpoint of another
model, naming the parameter.
"""

import json
import random
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ALL_CASES, SCRIPTS, requires, torchrun

from hasten import Accelerator
from hasten.checkpointing.accelerate_format import open_checkpoint
from hasten.errors import CheckpointError
from hasten.strategies.deepspeed.resharding import read_zero_checkpoint
from hasten.strategies.engine_change import StateByName, fill_from_torch_checkpoint, load_state_by_name

pytestmark = [pytest.mark.slow, requires("deepspeed")]

SCRIPT = SCRIPTS / "resume_matrix.py"
TIMEOUT = 900
WORLDS = {"single": (1,), "ddp": (2, 4)} | {engine: (1, 2, 4) for engine in ("fsdp2", "zero1", "zero2", "zero3")}
LAYOUTS = [f"{engine}_w{world}" for engine, worlds in WORLDS.items() for world in worlds]
SEED = 32


def _engine(layout: str) -> str:
    return layout.rsplit("_w", 1)[0]


def _world(layout: str) -> int:
    return int(layout.rsplit("_w", 1)[1])


def _kind(layout: str) -> str:
    return "ddp" if _engine(layout) == "single" else _engine(layout)


def _covers(pair: tuple[str, str]) -> set:
    source, target = pair
    return {("kinds", _kind(source), _kind(target)), ("source", source), ("target", target)}


def _score(pair: tuple[str, str], needed: set) -> int:
    """What a pair adds to the sample: what it holds that is not held yet, less for a resume on 4 processes."""
    return len(_covers(pair) & needed) - 2 * (_world(pair[1]) == 4)


def _in_four_launches(pair: tuple[str, str]) -> bool:
    """Whether the sample's four launches hold the pair: resumed on as many processes as saved it or more, or on one."""
    return _world(pair[0]) <= _world(pair[1]) or _world(pair[1]) == 1


def sample(seed: int = SEED) -> list[tuple[str, str]]:
    """Pairs that hold every kind of pair and every layout as a source and as a target, chosen greedily (the most not
    yet held, fewer resumes on 4 processes, then the seed's order) among those :func:`_in_four_launches` holds."""
    pairs = [(s, t) for s in LAYOUTS for t in LAYOUTS if s != t and _in_four_launches((s, t))]
    random.Random(seed).shuffle(pairs)
    needed = set().union(*map(_covers, pairs))
    chosen = []
    while needed:
        best = max(pairs, key=lambda pair: (not _covers(pair).isdisjoint(needed), _score(pair, needed)))
        chosen.append(best)
        needed -= _covers(best)
    return sorted(chosen, key=lambda pair: (_world(pair[1]), pair[1], pair[0]))


PAIRS = [(source, target) for source in LAYOUTS for target in LAYOUTS if source != target] if ALL_CASES else sample()


def plan(pairs: list[tuple[str, str]]) -> list[dict]:
    """The launches: from the fewest processes up, each runs its layouts, then resumes the sources saved so far; then,
    from the most processes down, a launch resumes the sources of more processes."""
    used = sorted({layout for pair in pairs for layout in pair}, key=LAYOUTS.index)
    worlds = sorted({_world(layout) for layout in used})
    ordered = sorted(pairs, key=lambda pair: "fsdp2" in pair[0] + pair[1])  # the engines that came first, first

    def resumes(world: int, later: bool) -> list[list[str]]:
        here = [pair for pair in ordered if _world(pair[1]) == world]
        return [["resume", _engine(t), s] for s, t in here if (_world(s) > world) == later]

    launches = [
        {"world": w, "steps": [["run", _engine(x)] for x in used if _world(x) == w] + resumes(w, later=False)}
        for w in worlds
    ]
    launches += [{"world": w, "steps": resumes(w, later=True)} for w in reversed(worlds) if resumes(w, later=True)]
    return launches


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every launch of the plan, run even when one fails: each pair's test reads its own lines."""
    root = tmp_path_factory.mktemp("matrix")
    launches = plan(PAIRS)
    (root / "plan.json").write_text(json.dumps(launches))
    text = ""
    for index, launch in enumerate(launches):
        out = torchrun(SCRIPT, str(root), str(index), nproc=launch["world"], timeout=TIMEOUT, check=False)
        text += (
            f"\n--- launch {index} on {launch['world']} process(es), exit {out.returncode}\n{out.stdout}{out.stderr}"
        )
    return SimpleNamespace(root=root, text=text, launches=launches)


def _said(text: str, what: str, world: int) -> None:
    """Every process printed that ``what`` passed; else the lines that say why not (or the launches' end)."""
    missing = [rank for rank in range(world) if f"rank {rank}: {what} passed" not in text]
    if missing:
        failed = [line for line in text.splitlines() if f"{what} FAILED" in line or " FAILED: " in line]
        raise AssertionError(
            f"{what}: not passed on rank(s) {missing} (a launch ends at its first failure):\n"
            + "\n".join(failed or [text[-6000:]])
        )


def test_the_sample_holds_every_kind_of_pair_and_every_layout_both_ways_in_four_launches():
    chosen = sample()
    kinds = {_kind(layout) for layout in LAYOUTS}
    assert {(_kind(s), _kind(t)) for s, t in chosen} == {(a, b) for a in kinds for b in kinds}
    assert {s for s, _ in chosen} == {t for _, t in chosen} == set(LAYOUTS)
    assert sum(_world(t) == 4 for _, t in chosen) == 5  # one per layout on 4 processes
    assert [launch["world"] for launch in plan(chosen)] == [1, 2, 4, 1]
    assert sample() == chosen  # the same seed, the same sample


def test_every_layout_trains_on_the_same_global_batches(matrix):
    orders = {}
    for launch in matrix.launches:
        for action, engine, *_ in launch["steps"]:
            if action == "run":
                name = f"{engine}_w{launch['world']}"
                _said(matrix.text, f"run {name}", launch["world"])
                orders[name] = json.loads((matrix.root / "records" / f"{name}.ids.json").read_text())
    first = sum(next(iter(orders.values())), [])
    assert sorted(first) == list(range(len(first)))  # the epoch, each sample once
    assert all(sum(order, []) == first for order in orders.values()), orders


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_resume(matrix, source, target):
    _said(matrix.text, f"resume {target} from {source}", _world(target))


# ------------------------------------------------------------------------------ without a launch


def _build(engine: str) -> SimpleNamespace:
    """The launches' model, optimizer, schedule and loader under ``engine`` on this one process."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from resume_matrix import build
    finally:
        sys.path.remove(str(SCRIPTS))
    return build(engine)


def _live(run: SimpleNamespace) -> dict[str, torch.Tensor]:
    weights = run.accelerator.get_state_dict(run.model)
    return {name: tensor.clone() for name, tensor in weights.items()}


DAMAGED = {
    "zero2_w2-single": ("zero2_w2", "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt", "single"),
    "zero3_w2-fsdp2": ("zero3_w2", "deepspeed/state/zero_pp_rank_1_mp_rank_00_model_states.pt", "fsdp2"),
    "fsdp2_w2-single": ("fsdp2_w2", "pytorch_model_fsdp_0/__1_0.distcp", "single"),
    "fsdp2_w2-single-optimizer": ("fsdp2_w2", "optimizer_fsdp_0/__0_0.distcp", "single"),
}


@pytest.mark.parametrize("how", ["corrupt", "missing"])
@pytest.mark.parametrize("source,shard,target", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_corrupt_or_missing_shard_is_refused_naming_it_before_anything_changes(
    matrix, tmp_path, source, shard, target, how
):
    folder = tmp_path / source
    shutil.copytree(matrix.root / source, folder)
    victim = folder / shard
    if how == "corrupt":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    run = _build(target)
    before = _live(run)
    with pytest.raises(CheckpointError, match=victim.name):
        run.accelerator.load_state(str(folder))
    after = _live(run)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items()), "the live weights changed"
    assert not run.optimizer.state_dict()["state"], "the optimizer got a state"


def _model(**changes) -> torch.nn.Module:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from zero_resharding import TinyTransformer
    finally:
        sys.path.remove(str(SCRIPTS))
    model = TinyTransformer()
    for name, module in changes.items():
        setattr(model, name, module)
    return model


def _empty(reader) -> StateByName:
    return StateByName(stage=2, world_size=2, folder=reader.directory)


def _groups(model) -> list[list[str]]:
    """The names of the launches' two groups: the matrices, then the rest."""
    params = dict(model.named_parameters())
    matrices = [name for name, param in params.items() if param.dim() >= 2]
    return [matrices, [name for name in params if name not in matrices]]


def test_a_torch_checkpoint_of_another_model_is_refused_naming_the_parameter(matrix):
    reader = open_checkpoint(matrix.root / "ddp_w2", 0, [None])
    model = _model(up=torch.nn.Linear(16, 64))
    with pytest.raises(CheckpointError, match=r"parameter 'up.weight' has shape \(32, 16\) in the checkpoint and"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, _groups(model), "here")
    model = _model(extra=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"has no parameter 'extra.bias', which the model has"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, _groups(model), "here")
    model = _model()
    with pytest.raises(CheckpointError, match=r"groups of \[5, 5\] parameters, but this run's optimizer has \[10\]"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, [sum(_groups(model), [])], "here")
    groups = _groups(model)
    groups[0][1], groups[0][2] = groups[0][2], groups[0][1]  # the optimizer holds them in another order
    with pytest.raises(CheckpointError, match=r"'exp_avg' saved for parameter 'proj.weight' has shape \(48, 16\)"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, groups, "here")


def test_a_zero_checkpoint_of_another_model_is_refused_naming_the_parameter_and_nothing_changes(matrix):
    full = read_zero_checkpoint(matrix.root / "zero2_w2")
    model = _model(up=torch.nn.Linear(16, 64))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"parameter 'up.weight' has shape \(32, 16\) in the checkpoint and"):
        load_state_by_name(full, model, [optimizer], "here")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="holds 2 parameter groups; the optimizer has 1"):
        load_state_by_name(full, model, [optimizer], "here")


def test_load_state_on_one_process_refuses_a_zero_checkpoint_of_another_model(matrix):
    accelerator = Accelerator(cpu=True)
    model = _model(extra=torch.nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(range(8), batch_size=4)
    model, optimizer, _, _ = accelerator.prepare(model, optimizer, loader, scheduler)  # what the checkpoint holds
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"has no parameter 'extra.bias', which the model has"):
        accelerator.load_state(str(matrix.root / "zero3_w2"))
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not optimizer.state_dict()["state"]
