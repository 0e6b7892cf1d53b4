"""`linnet adapters`: several adapters trained over one base in one process, each equal to
the run it would have been alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from linnet import cli
from linnet.commands import adapters, dpo, quickstart, sft
from linnet.config import load_any
from tests.conftest import quickstart_model

torch.set_num_threads(1)

COMMON = {"model": {"card": None}, "training": {"context_length": 128}, "optimizer": {"lr": 3e-3},
          "lr_schedule": {"warmup_steps": 1}, "evaluation": {"every": 2}}
# each its own data, rank, targets, dropout, DoRA, learning rate, schedule, steps and seed
TENANTS = {
    "arith": ("train.jsonl", {"lora": {"enabled": True, "rank": 4, "targets": ["q_proj", "v_proj"], "dropout": 0.1},
                              "training": {"steps": 4, "checkpoint_every": 2}, "runtime": {"seed": 1}}),
    "dora": ("train.jsonl", {"lora": {"enabled": True, "rank": 8, "targets": "all-linear", "dora": True},
                             "training": {"steps": 6}, "optimizer": {"lr": 1e-3},
                             "lr_schedule": {"name": "constant", "warmup_steps": 0}, "runtime": {"seed": 2}}),
    "prefs": ("pairs.jsonl", {"lora": {"enabled": True, "rank": 8}, "dpo": {"pairs_per_step": 8, "beta": 0.5},
                              "training": {"steps": 3, "checkpoint_every": 2}, "runtime": {"seed": 3}}),
    "short": ("short.jsonl", {"lora": {"enabled": True, "rank": 2, "alpha": 4}, "training": {"steps": 5},
                              "data": {"eval_share": 0.2}, "runtime": {"seed": 4}}),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    problems = list(quickstart.problems(rng, 300, 2))
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                              for p, a in problems[:200]))
    (root / "short.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                              for p, a in problems[200:]))
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": p, "chosen": a, "rejected": f"{(int(a) + int(rng.integers(1, 50))) % 200:03d}"}) + "\n"
        for p, a in quickstart.problems(rng, 200, 2)))
    return root


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _write_configs(workspace, out, names=TENANTS, **changes) -> list:
    """Each tenant's YAML config (writing into out/NAME), its `changes` applied; the paths."""
    import yaml

    paths = []
    for name in names:
        data_file, own = TENANTS[name]
        data = _merge(_merge(COMMON, {"model": {"card": str(workspace / "model")},
                                      "data": {"path": str(workspace / data_file), "chat": False, "eval_share": 0.1},
                                      "runtime": {"output_dir": str(out / name)}}), own)
        data = _merge(data, changes.get(name, {}))
        path = out.parent / f"{out.name}-{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        paths.append(path)
    return paths


def _list_file(path, configs) -> str:
    path.write_text("adapters:\n" + "".join(f"  - {c}\n" for c in configs))
    return str(path)


def _metrics(directory) -> list[dict]:
    return [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]


def _same_run(run, alone) -> None:
    """Losses, held-out metrics and the exported adapter weights equal to 1e-6."""
    a, b = _metrics(run), _metrics(alone)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for key in [k for k in y if k == "loss" or k.startswith("held_out")]:
            assert x[key] == pytest.approx(y[key], abs=1e-6), key
    wa, wb = (load_file(d / "final" / "adapter_model.safetensors") for d in (run, alone))
    assert sorted(wa) == sorted(wb)
    for key in wb:
        np.testing.assert_allclose(wa[key], wb[key], rtol=0, atol=1e-6, err_msg=key)


def test_four_adapters_in_one_run_equal_four_runs_alone(workspace, tmp_path, capsys):
    configs = _write_configs(workspace, tmp_path / "together")
    assert cli.main(["adapters", "--config", _list_file(tmp_path / "tenants.yaml", configs)]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in TENANTS)
    for name, path in zip(TENANTS, configs, strict=True):
        config = load_any(str(path), [f"runtime.output_dir={tmp_path / 'alone' / name}"])
        (dpo.run if config.command == "dpo" else sft.run)(config)
        _same_run(tmp_path / "together" / name, tmp_path / "alone" / name)
        summary = json.loads((tmp_path / "together" / name / "summary.json").read_text())
        assert summary["steps_this_run"] == TENANTS[name][1]["training"]["steps"]
    ranks = {json.loads((tmp_path / "together" / n / "final" / "adapter_config.json").read_text())["r"]
             for n in TENANTS}
    assert ranks == {2, 4, 8}


def test_resumed_adapters_equal_an_uninterrupted_run(workspace, tmp_path):
    names = ("arith", "prefs")
    whole = adapters.run([(None, load_any(str(p))) for p in _write_configs(workspace, tmp_path / "whole", names)])
    assert all(t.error is None for t in whole)
    configs = [load_any(str(p)) for p in _write_configs(workspace, tmp_path / "cut", names)]
    adapters.run([(None, c) for c in configs])
    for name in names:  # as if killed after step 3: step 2's checkpoint and two metrics lines remain
        run = tmp_path / "cut" / name
        for later in sorted((run / "checkpoints").iterdir())[1:]:
            shutil.rmtree(later)
        (run / "summary.json").unlink()
        lines = (run / "metrics.jsonl").read_text().splitlines()[:2]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    resumed = adapters.run([(None, c) for c in configs], resume=True)
    assert [t.summary["steps_this_run"] for t in resumed] == [2, 1]
    for name in names:
        _same_run(tmp_path / "cut" / name, tmp_path / "whole" / name)


def test_a_bad_adapter_stops_every_run_before_anything_is_written(workspace, tmp_path):
    configs = _write_configs(workspace, tmp_path / "runs", ("arith", "short"),
                             short={"data": {"path": str(workspace / "missing.jsonl")}})
    with pytest.raises(ValueError, match="adapter 'short'.*missing.jsonl"):
        adapters.run([(None, load_any(str(p))) for p in configs])
    assert not (tmp_path / "runs").exists()


def test_a_run_that_fails_mid_way_leaves_the_others_training(workspace, tmp_path, capsys):
    configs = _write_configs(workspace, tmp_path / "runs", ("arith", "short"), short={"optimizer": {"lr": 1e30}})
    assert cli.main(["adapters", "--config", _list_file(tmp_path / "tenants.yaml", configs)]) == 1
    assert "short" in capsys.readouterr().out
    assert len(_metrics(tmp_path / "runs" / "arith")) == 4
    assert (tmp_path / "runs" / "arith" / "final" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "runs" / "short" / "final").exists()


@pytest.mark.parametrize("change, message", [
    ({"model": {"dtype": "bfloat16"}}, "model.dtype"),
    ({"lora": {"enabled": False}}, "lora.enabled"),
    ({"runtime": {"output_dir": "SAME"}}, "runtime.output_dir"),
])
def test_what_one_base_cannot_train_is_refused(workspace, tmp_path, change, message):
    if change.get("runtime", {}).get("output_dir") == "SAME":
        change = {"runtime": {"output_dir": str(tmp_path / "runs" / "arith")}}
    configs = _write_configs(workspace, tmp_path / "runs", ("arith", "short"), short=change)
    with pytest.raises(ValueError, match=message):
        adapters.run([("one", load_any(str(configs[0]))), ("two", load_any(str(configs[1])))])
    assert not (tmp_path / "runs").exists()


def test_the_list_file_names_a_bad_entry(tmp_path):
    bad = tmp_path / "tenants.yaml"
    bad.write_text("adapters:\n  - {config: a.yaml, rank: 4}\n")
    with pytest.raises(ValueError, match=r"adapters\[0\].*rank"):
        adapters.read_list(str(bad))
    bad.write_text("tenants: [a.yaml]\n")
    with pytest.raises(ValueError, match="adapters: give a list"):
        adapters.read_list(str(bad))


def test_ctrl_c_in_one_run_stops_every_run(workspace, tmp_path, monkeypatch, capsys):
    configs = _write_configs(workspace, tmp_path / "runs", ("arith", "short"))
    stepped = adapters.Tenant.stepped

    def interrupted_at_step_2(self, on_step):
        after = stepped(self, on_step)

        def step(record):
            if self.name == "short" and record.step == 2:
                raise KeyboardInterrupt
            after(record)

        return step

    monkeypatch.setattr(adapters.Tenant, "stepped", interrupted_at_step_2)
    assert cli.main(["adapters", "--config", _list_file(tmp_path / "tenants.yaml", configs)]) == 130
    assert "--resume" in capsys.readouterr().err
    # arith had taken step 2 before short's, and stopped waiting for its next turn
    assert len(_metrics(tmp_path / "runs" / "arith")) == 2 and len(_metrics(tmp_path / "runs" / "short")) == 1
    assert not any((tmp_path / "runs" / name / "final").exists() for name in ("arith", "short"))
