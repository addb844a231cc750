"""Smoke tests of the examples, launched the way users launch them: ``hasten launch --num_processes 2``."""

import ast
import importlib.util
import re

import pytest

from helpers import ROOT, hasten_launch

EXAMPLES = ROOT / "examples"
# Generous: other jobs may share the two cores, and DeepSpeed may first have to compile its CPU ops.
TIMEOUT = 600


def _bar_starts(stderr: str, description: str) -> int:
    """How many progress bars called ``description`` were started (each prints its 0% state once)."""
    return stderr.count(f"{description}:   0%|")


def _numbers(pattern: str, text: str) -> dict[int, float]:
    """``{int(group 1): float(group 2)}`` for every match of ``pattern``."""
    return {int(step): float(value) for step, value in re.findall(pattern, text)}


@pytest.mark.slow
def test_digits_classifier_shows_each_bar_once():
    proc = hasten_launch(EXAMPLES / "digits_classifier.py", "--epochs", "3", timeout=TIMEOUT)
    accuracies = [float(a) for a in re.findall(r"test accuracy ([0-9.]+) on 360 samples", proc.stdout)]
    assert len(accuracies) == 3, proc.stdout
    assert accuracies[-1] > 0.85, accuracies
    assert [_bar_starts(proc.stderr, f"epoch {epoch}") for epoch in range(3)] == [1, 1, 1], proc.stderr[-3000:]


@pytest.mark.slow
def test_language_model_reaches_its_loss_and_resumes_where_it_stopped(tmp_path):
    from helpers import read_scalars

    run = tmp_path / "run"
    first = hasten_launch(EXAMPLES / "language_model.py", "--output_dir", str(run), timeout=TIMEOUT)
    losses = _numbers(r"step (\d+): loss ([0-9.]+)", first.stdout)
    assert sorted(losses) == list(range(10, 101, 10)), first.stdout
    held_out = _numbers(r"step (\d+): held-out loss ([0-9.]+) \(perplexity [0-9.]+\) on 249 sequences", first.stdout)
    assert sorted(held_out) == [50, 100], first.stdout  # 249: every held-out sequence once, none padded in
    assert held_out[100] < 2.75, held_out  # the threshold stated in the example's docstring
    assert losses[100] < losses[10] - 1.5, losses
    # One progress bar per machine, not one per process.
    assert _bar_starts(first.stderr, "training") == 1 and _bar_starts(first.stderr, "evaluating") == 2, first.stderr[-3000:]

    second = hasten_launch(EXAMPLES / "language_model.py", "--output_dir", str(run), "--resume", "--max_steps", "110", timeout=TIMEOUT)
    assert f"resumed from {run / 'checkpoints' / 'checkpoint_1'} at step 100" in second.stdout, second.stdout
    resumed = _numbers(r"step (\d+): loss ([0-9.]+)", second.stdout)
    assert sorted(resumed) == [110], second.stdout
    assert abs(resumed[110] - losses[100]) < 0.25 and resumed[110] < losses[50], (losses, resumed)
    assert _bar_starts(second.stderr, "training") == 0 and second.stderr.count("training:  91%|") == 1, second.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]

    scalars = read_scalars(run / "language_model")
    train_steps = sorted(step for tag, step, _ in scalars if tag == "train/loss")
    assert train_steps == list(range(10, 111, 10)), train_steps
    assert sorted(step for tag, step, _ in scalars if tag == "eval/perplexity") == [50, 100, 110]


@pytest.mark.slow
def test_find_batch_size_halves_until_the_batch_fits():
    out = hasten_launch(EXAMPLES / "find_batch_size.py", timeout=TIMEOUT).stdout
    assert [int(size) for size in re.findall(r"trying batch size (\d+) per process", out)] == [256, 128, 64, 32, 16], out
    match = re.search(r"trained with batch size 16 per process: accuracy ([0-9.]+) on 500 held-out samples", out)
    assert match and float(match.group(1)) > 0.85, out


@pytest.mark.slow
def test_early_stopping_stops_every_rank_at_the_same_step():
    out = hasten_launch(EXAMPLES / "early_stopping.py", timeout=TIMEOUT).stdout
    stops = _numbers(r"rank (\d+): stopped at step (\d+) of 400", out)
    assert sorted(stops) == [0, 1] and stops[0] == stops[1] < 400, out
    asked = _numbers(r"rank (\d+): step (\d+): patience ran out", out)
    assert asked and all(step == stops[0] for step in asked.values()), out
    assert re.search(r"validation loss on all 64 samples: [0-9.]+", out), out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install 'hasten[deepspeed]')")
def test_deepspeed_config_with_auto_values():
    flags = ("--num_processes", "2", "--use_deepspeed", "--deepspeed_config_file", str(EXAMPLES / "ds_config_zero2.json"))
    out = hasten_launch(EXAMPLES / "deepspeed_config.py", launch_args=flags, timeout=TIMEOUT).stdout
    resolved = (
        'DeepSpeed ZeRO-2, resolved config values: {"train_micro_batch_size_per_gpu": 32, "train_batch_size": 128, '
        '"gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "optimizer.params.lr": 0.01, '
        '"scheduler.params.warmup_num_steps": 5, "scheduler.params.total_num_steps": 32}'  # 2 epochs x 16 optimizer steps
    )
    assert resolved in out and "distributed type DEEPSPEED, 2 process(es)" in out, out
    accuracies = [float(a) for a in re.findall(r"epoch \d: accuracy ([0-9.]+) on 512 held-out samples", out)]
    assert len(accuracies) == 2 and accuracies[-1] > 0.85, out


def test_transformers_script_differs_from_its_accelerate_version_only_in_imports():
    source = (EXAMPLES / "transformers_no_trainer.py").read_text()
    tree = ast.parse(source)
    hasten_imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "hasten"]
    assert sorted(node.module for node in hasten_imports) == ["hasten", "hasten.logging", "hasten.utils"]
    import_lines = {line for node in hasten_imports for line in range(node.lineno, node.end_lineno + 1)}
    docstring_lines = set(range(tree.body[0].lineno, tree.body[0].end_lineno + 1))
    code = [line for number, line in enumerate(source.splitlines(), 1) if number not in import_lines | docstring_lines]
    assert not [line for line in code if "hasten" in line]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed (pip install transformers): the real-client test needs it")
def test_transformers_no_trainer_script_trains_checkpoints_and_saves(tmp_path):
    args = ("--max_train_steps", "30", "--checkpointing_steps", "20", "--output_dir", str(tmp_path), "--with_tracking")
    # transformers imports peft when it is installed (the ecosystem tests install it), and peft imports accelerate:
    # users with such libraries launch with --as_accelerate so that those imports reach hasten.
    out = hasten_launch(EXAMPLES / "transformers_no_trainer.py", *args, launch_args=("--as_accelerate", "--num_processes", "2"), timeout=TIMEOUT).stdout
    losses = _numbers(r"step (\d+): loss ([0-9.]+)", out)
    assert sorted(losses) == [10, 20, 30] and losses[30] < 3.6, out  # from ln(256) = 5.5 at the start
    # 157 validation blocks: the per-batch losses repeated to the batch size, gathered without the padding.
    eval_loss = re.search(r"epoch 0: eval_loss ([0-9.]+) perplexity [0-9.]+ over 157 values", out)
    assert eval_loss and float(eval_loss.group(1)) < 3.6, out
    assert {"config.json", "model.safetensors", "all_results.json", "step_20", "clm_no_trainer"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.slow
def test_tp_fsdp_llama_learns_on_four_processes_holding_a_quarter_each():
    proc = hasten_launch(EXAMPLES / "tp_fsdp_llama.py", "--steps", "40", launch_args=("--cpu", "--num_processes", "4"), timeout=TIMEOUT)
    assert "mesh {'dp_replicate': 1, 'dp_shard': 2, 'tp': 2}" in proc.stdout, proc.stdout
    fractions = [float(f) for f in re.findall(r"holds ([0-9.]+) of the parameter bytes", proc.stdout)]
    assert len(fractions) == 4 and all(0.25 <= f < 0.26 for f in fractions), fractions
    before = float(re.search(r"held-out loss before training ([0-9.]+)", proc.stdout).group(1))
    after = float(re.search(r"held-out loss after 40 steps ([0-9.]+)", proc.stdout).group(1))
    assert before > 5.0 and after < 3.2, (before, after)
