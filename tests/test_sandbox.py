"""The sandboxed code grader (linnet.rl.sandbox) and GRPO's `code` reward: a right program
scores 1 and a partial one its share; each escape that issue 43 lists scores 0, while the
test process (the trainer) keeps running and nothing outside the sandbox changes."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest

from linnet.commands.grpo import check_tests
from linnet.data.readers import Record
from linnet.rl import rewards
from linnet.rl.rollouts import Prompt
from linnet.rl.sandbox import as_tests, run_tests

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux only")

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", {"call": "add(2, 2)", "expect": 4},
         "assert add('a', 'b') == 'ab'"]


def _processes_in(folder) -> list[str]:
    """The processes whose working directory lies in `folder` (a sandbox's, or its children's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(autouse=True)
def contained(tmp_path, monkeypatch):
    """Sandboxes made in this test's folder; none of their folders or processes outlives the run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("linnet-sandbox-")] == []
    assert _processes_in(tmp_path) == []


def test_a_right_program_scores_1_and_a_partial_one_its_share():
    right = run_tests(ADD, TESTS)
    assert (right.passed, right.total, right.status, right.share) == (4, 4, "ok", 1.0)
    ints_only = "def add(a, b):\n    if not isinstance(a, int):\n        raise TypeError(a)\n    return a + b\n"
    partial = run_tests(ints_only, TESTS)  # the raising test counts 0; the others still run
    assert (partial.passed, partial.status, partial.share) == (3, "failed", 0.75)
    assert "test 3: TypeError: a" in partial.stderr
    assert run_tests(ADD, "assert add(1, 2) == 3\nassert add(2, 2) == 5").share == 0.0  # one block: one test
    broken = run_tests("def add(a, b):\n    return a +\n", TESTS)
    assert (broken.share, broken.status) == (0.0, "failed") and "SyntaxError" in broken.stderr


def test_tests_that_cannot_run_or_cannot_fail_are_refused_with_the_reason():
    assert as_tests([{"call": "f(1)", "expect": [1, "a"]}]) == ["assert (f(1)) == [1, 'a']"]
    for tests, reason in [([], "give a list"), (None, "NoneType"), (["assert f("], "not Python"),
                          (["f(1)"], "asserts nothing"), ("42", "asserts nothing"),
                          ([{"call": "f(1)"}], "test 0 is")]:
        with pytest.raises(ValueError, match=reason):
            as_tests(tests)
    with pytest.raises(ValueError, match="timeout=0"):
        run_tests(ADD, TESTS, timeout=0)


def test_a_fork_bomb_is_contained():
    outcome = run_tests("import os\nwhile True:\n    os.fork()\n", TESTS)
    assert (outcome.share, outcome.status) == (0.0, "refused") and "os.fork" in outcome.stderr


def test_an_infinite_loop_is_stopped():
    start = time.monotonic()
    outcome = run_tests("while True:\n    pass\n", TESTS, cpu_seconds=1, timeout=3)
    assert (outcome.share, outcome.status) == (0.0, "timeout")
    assert time.monotonic() - start < 4.5
    asleep = run_tests("import time\ntime.sleep(60)\n", TESTS, timeout=1)  # no CPU spent: the wall clock
    assert (asleep.share, asleep.status) == (0.0, "timeout")


def test_a_10_gb_allocation_fails_inside():
    outcome = run_tests("data = bytearray(10 * 1024 ** 3)\n" + ADD, TESTS)
    assert outcome.share == 0.0 and "MemoryError" in outcome.stderr


def test_writes_outside_the_sandbox_directory_do_not_happen(contained):
    for target in [contained / "outside.txt", "../escaped.txt"]:
        outcome = run_tests(f"open({str(target)!r}, 'w').write('x')\n" + ADD, TESTS)
        assert (outcome.share, outcome.status) == (0.0, "refused")
    assert sorted(p.name for p in contained.iterdir()) == []
    inside = run_tests("open('notes.txt', 'w').write('x')\n" + ADD, TESTS)  # its own directory is its to use
    assert inside.share == 1.0


def test_no_network_connection_reaches_a_server_of_the_trainer():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))\n" + ADD
        outcome = run_tests(code, TESTS)
        with pytest.raises(TimeoutError):
            server.accept()
    assert (outcome.share, outcome.status) == (0.0, "refused")


def test_the_trainers_environment_is_not_readable(monkeypatch):
    monkeypatch.setenv("LINNET_SANDBOX_SECRET", "s3cret")
    seen = run_tests("import os\nsecret = os.environ.get('LINNET_SANDBOX_SECRET')\nprint(sorted(os.environ))",
                     ["assert secret == 's3cret'"])
    assert (seen.share, seen.status) == (0.0, "failed")
    through_proc = run_tests("import os\nenviron = open(f'/proc/{os.getppid()}/environ').read()", ["assert environ"])
    assert (through_proc.share, through_proc.status) == (0.0, "refused")


def test_killing_the_trainer_fails_and_it_keeps_running():
    """The trainer is this test's process: were a signal delivered, the run would end here."""
    for kill in ["os.kill(os.getppid(), signal.SIGKILL)", "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)"]:
        outcome = run_tests(f"import os, signal\n{kill}\n" + ADD, TESTS)
        assert (outcome.share, outcome.status) == (0.0, "refused")


def test_the_code_cannot_forge_its_score():
    """Its records carry a nonce it never sees; the loop's exec and the hook are bound before it runs."""
    forged = run_tests("import os\nprint('\\n0123 pass 0')\nos._exit(0)\n", ["assert False"])
    assert (forged.share, forged.status) == (0.0, "crashed")
    rebound = run_tests("import builtins\nbuiltins.exec = lambda *a, **k: None\n", ["assert False"])
    assert (rebound.share, rebound.status) == (0.0, "failed")


def test_the_code_reward_grades_the_completions_last_python_block():
    tok = SimpleNamespace(decode=lambda ids: "".join(map(chr, ids)), eos_ids=(0,))
    enc = lambda s: [ord(c) for c in s] + [0]  # noqa: E731
    reward = rewards.resolve("code", tok)
    prompt = Prompt(enc("Write add."), TESTS)
    fenced = "```python\ndef add(a, b):\n    return 0\n```\nBetter:\n```python\n" + ADD + "```\nDone."
    assert reward(prompt, enc(fenced)) == 1.0
    assert reward(prompt, enc(ADD)) == 1.0  # no block: the whole completion
    ints_only = "def add(a, b):\n    return a + b if isinstance(a, int) else None\n"
    items = [(prompt, enc(ADD)), (prompt, enc(ints_only)), (prompt, enc("oops"))]
    assert rewards.Concurrent(reward, 3).batch(items) == [1.0, 0.75, 0.0]
    with pytest.raises(ValueError, match="data.answer"):
        reward(Prompt(enc("Write add."), None), enc(ADD))
    records = [Record("code.jsonl line 1", {"tests": TESTS}), Record("code.jsonl line 2", {"tests": "42"})]
    with pytest.raises(ValueError, match=r"code.jsonl line 2: field 'tests' holds the code reward's tests .*asserts"):
        check_tests(records, "tests")


def test_linnet_grpo_grades_with_the_code_reward(tmp_path):
    """`grpo.rewards: [code, format]` with `data.answer: tests`: the records' tests reach the
    sandbox, graded two completions at a time, and the run logs each reward."""
    from linnet.commands.grpo import run
    from linnet.config import GRPOConfig, load
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    records = [{"prompt": f"{a}+{b}=", "tests": [f"assert add({a}, {b}) == {a + b}"]} for a in range(4) for b in range(5)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run(load(GRPOConfig, None, [
        f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'code.jsonl'}", "data.answer=tests",
        "data.chat=false", "data.eval_share=0.1", "training.context_length=64", "grpo.group=4",
        "grpo.prompts_per_step=4", "grpo.max_new_tokens=3", "grpo.rewards=[code, format]",
        "grpo.format_pattern='```python'", "grpo.reward_workers=2",
        "training.steps=1", "lr_schedule.warmup_steps=0", f"runtime.output_dir={tmp_path / 'run'}"]))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward_code"] == metrics[0]["reward_format"] == 0.0  # three random tokens define no add
    assert metrics[0]["held_out_reward"] == 0.0


def test_the_code_rewards_limits_come_from_the_config(tmp_path, monkeypatch):
    """grpo.sandbox_timeout and grpo.sandbox_memory_mb reach run_tests (CPU seconds: half
    the wall clock); nonsense is refused."""
    from linnet.commands.grpo import prompts_and_rewards
    from linnet.config import GRPOConfig, load
    from linnet.rl.sandbox import Outcome
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "tests": [f"assert add({a}, 1)"]})
                                                 + "\n" for a in range(8)))
    fields = [f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'code.jsonl'}", "data.answer=tests",
              "data.chat=false", "training.context_length=64", "grpo.prompts_per_step=2", "grpo.max_new_tokens=3",
              "grpo.rewards=[code]", "training.steps=1", "lr_schedule.warmup_steps=0"]
    seen = {}
    monkeypatch.setattr(rewards.sandbox, "run_tests", lambda code, tests, **kw: seen.update(kw) or Outcome(1, 1, "ok"))
    config = load(GRPOConfig, None, [*fields, "grpo.sandbox_timeout=30", "grpo.sandbox_memory_mb=256"])
    r = prompts_and_rewards(config, config.grpo)
    assert r.functions["code"](r.prompts[0], [3, 4]) == 1.0
    assert seen == {"timeout": 30.0, "cpu_seconds": 15, "memory_mb": 256}
    with pytest.raises(ValueError, match="sandbox_timeout"):
        load(GRPOConfig, None, [*fields, "grpo.sandbox_timeout=0"])
