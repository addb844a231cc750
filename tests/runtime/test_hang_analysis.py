"""Who waits for whom in a hang, from every rank's published counts of collectives per process group; the report
built from that; the user's frames read from a process's stacks."""

from __future__ import annotations

from hasten.runtime import hang_analysis, hang_report, stack_dump
from hasten.runtime.hang_analysis import Wait


def _at(**groups: int) -> dict:
    return {"seq": 0, "op": "", "status": "done", "groups": groups}


def test_a_rank_ahead_of_another_in_a_group_waits_in_that_collective():
    positions = {0: _at(**{"0": 10}), 1: _at(**{"0": 9}), 2: _at(**{"0": 10})}
    assert hang_analysis.find_wait(0, positions) == Wait("0", 10, {1: 9})
    assert hang_analysis.find_wait(1, positions) is None  # behind: it waits for nobody
    assert hang_analysis.roles(Wait("0", 10, {1: 9}), positions) == {0: "waiting", 1: "cause", 2: "waiting"}


def test_every_rank_level_is_no_wait():
    positions = {0: _at(**{"0": 7, "1": 2}), 1: _at(**{"0": 7, "1": 2})}
    assert hang_analysis.find_wait(0, positions) is None


def test_a_rank_that_waits_in_another_group_itself_is_deadlocked_not_the_cause():
    # rank 0 in hasten's gather (default group), rank 1 in an all_reduce of a side group rank 0 never joins
    positions = {0: _at(**{"0": 1, "1": 0}), 1: _at(**{"0": 0, "1": 1})}
    wait = hang_analysis.find_wait(0, positions)
    assert wait == Wait("0", 1, {1: 0})
    assert hang_analysis.roles(wait, positions) == {0: "waiting", 1: "deadlocked"}
    assert hang_analysis.find_wait(1, positions) == Wait("1", 1, {0: 0})


def test_a_rank_that_published_nothing_or_exited_did_not_arrive():
    exited = {**_at(**{"0": 3}), "status": "exited", "error": "ValueError: boom"}
    positions = {0: _at(**{"0": 4}), 1: None, 2: exited}
    wait = hang_analysis.find_wait(0, positions)
    assert wait == Wait("0", 4, {1: None, 2: 3})
    assert hang_analysis.roles(wait, positions) == {0: "waiting", 1: "cause", 2: "exited"}


def test_groups_a_rank_is_not_in_do_not_count():
    # ranks 0 and 1 share group 1; rank 2 is not in it and never publishes a count for it
    positions = {0: _at(**{"0": 5, "1": 3}), 1: _at(**{"0": 5, "1": 3}), 2: _at(**{"0": 5})}
    assert hang_analysis.find_wait(0, positions) is None
    positions[0] = _at(**{"0": 5, "1": 4})
    assert hang_analysis.find_wait(0, positions) == Wait("1", 4, {1: 3})


def test_per_device_backends_are_groups_of_their_own():
    positions = {0: _at(**{"0:cuda": 8, "0:cpu": 2}), 1: _at(**{"0:cuda": 7, "0:cpu": 2})}
    assert hang_analysis.find_wait(0, positions) == Wait("0:cuda", 8, {1: 7})
    assert hang_analysis.describe_group("0:cuda") == "the default process group, cuda backend"


_OWN = """Thread MainThread:
  File "<frozen runpy>", line 88, in _run_code
  File "/work/train.py", line 31, in <module>
    sleep_instead()
  File "/work/train.py", line 20, in sleep_instead
    time.sleep(120)

Thread pin_memory:
  File "/usr/lib/python3.11/threading.py", line 327, in wait
    waiter.acquire()
"""

_FAULTHANDLER = """(its watchdog did not answer, a thread holds the GIL: stacks written by faulthandler, pid 7 on h)
Thread 0x00007f (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait

Current thread 0x00007e (most recent call first):
  File "/work/train.py", line 35 in hold_the_gil
  File "/work/train.py", line 50 in <module>
"""


def test_the_users_innermost_frames_are_read_from_either_kind_of_stack():
    assert stack_dump.user_frames(_OWN) == [
        ['File "/work/train.py", line 31, in <module>', "sleep_instead()"],
        ['File "/work/train.py", line 20, in sleep_instead', "time.sleep(120)"],
    ]
    assert stack_dump.user_frames(_FAULTHANDLER) == [
        ['File "/work/train.py", line 50 in <module>'],
        ['File "/work/train.py", line 35 in hold_the_gil'],
    ]
    assert stack_dump.user_frames("(no answer: the process is gone)") == []


def test_the_report_names_the_rank_that_did_not_arrive_as_the_cause():
    positions = {0: _at(**{"0": 10}), 1: _at(**{"0": 9})}
    hang = hang_report.Hang(
        rank=0,
        wait=Wait("0", 10, {1: 9}),
        waited=30.4,
        timeout=30,
        operation=None,
        positions=positions,
        stacks={
            0: 'Thread MainThread:\n  File "/work/train.py", line 12, in <module>\n    accelerator.backward(loss)\n',
            1: _OWN,
        },
    )
    text, record = hang_report.build(hang)
    lines = text.splitlines()
    assert lines[1] == (
        "[hasten] rank 0 has waited 30.4 s (HASTEN_HANG_TIMEOUT=30) in collective #10 of the default process group; "
        "rank 1 did not arrive."
    )
    assert lines[3] == (
        "  - rank 0 waited 30.4 s in it; its hang watchdog ended the job, at /work/train.py:12 in <module>: "
        "accelerator.backward(loss)"
    )
    assert lines[4] == (
        "  - rank 1 did not arrive (its last collective there is #9) and waits in no collective: it holds the others "
        "up, at /work/train.py:20 in sleep_instead: time.sleep(120)"
    )
    assert f"Stack of rank 1:\n{_OWN}" in text
    assert record["ranks"]["1"]["role"] == "cause" and record["ranks"]["0"]["role"] == "waiting"
    assert record["ranks"]["1"]["frames"][-1] == ['File "/work/train.py", line 20, in sleep_instead', "time.sleep(120)"]
    assert record["peers"] == lines[4] and record["peer_stacks"] == f"Stack of rank 1:\n{_OWN}"
    assert (record["collective"], record["group"], record["waited_s"]) == (10, "the default process group", 30.4)


def test_a_rank_that_went_on_asynchronously_waits_in_the_first_collective_another_did_not_issue():
    # NCCL: rank 0 queued collectives #10 to #13 before something waited for the GPU; rank 1 stopped after #9
    positions = {0: _at(**{"0": 13}), 1: _at(**{"0": 9})}
    wait = hang_analysis.find_wait(0, positions)
    assert wait == Wait("0", 10, {1: 9}, issued=13)
    hang = hang_report.Hang(0, wait, 30.0, 30, None, positions, {0: "", 1: ""})
    assert hang_report.build(hang)[0].splitlines()[1] == (
        "[hasten] rank 0 has waited 30.0 s (HASTEN_HANG_TIMEOUT=30) in collective #10 of the default process group "
        "(it issued up to #13: the collectives run asynchronously); rank 1 did not arrive."
    )
