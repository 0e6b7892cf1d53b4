"""Packed decentralized training (seed 002): PackedLlama and PackedAdamW against ordinary
models and AdamW, the topologies' matrices and phases, adaptive consensus's gamma, the
runner's packed runs, their snapshots (bitwise resume, refusals by name) and exports."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from linnet.cards import Card
from linnet.config import PretrainConfig
from linnet.config import load as load_config
from linnet.pretrain.consensus import AdaptiveConsensus, mixing_matrix, peer
from linnet.pretrain.decentralized import ALIGN, PackedLlama, local_mean_losses, ordinary
from linnet.pretrain.decentralized_optimizer import PackedAdamW
from linnet.pretrain.runner import run
from linnet.torch.distributed import clip_gradients
from linnet.train.optimizer import adamw
from tests.test_pretrain_runner import _config, _metrics, _same_weights, workspace  # noqa: F401

CARD = Card("packed-test", "llama", 96, 32, 64, 2, 4, 2, 8, tied_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
PACKED = ("training.accumulation=1", "training.micro_batch_size=4")  # 2 workers x 4 sequences: the global 8


def _packed_config(**over) -> PretrainConfig:
    sets = ["optimizer.weight_decay=0.1", "optimizer.grad_clip=0.5", "training.accumulation=1",
            "decentralized.num_models=2", *[f"{k}={v}" for k, v in over.items()]]
    return load_config(PretrainConfig, None, sets)


def _batch(n: int, seed: int, B: int = 3, T: int = 12):
    x = torch.randint(0, CARD.vocab, (n, B, T + 1), generator=torch.Generator().manual_seed(seed))
    return x[..., :-1], x[..., 1:]


# -- the model and optimizer ---------------------------------------------------------------


def test_seed_002_s_packed_block_runs_as_written():
    """Seed 002's block, its module names linnet's: PackedLlama(config.model, 4) from the
    config's model group, PackedAdamW(model, config), and the arenas it names."""
    config = load_config(PretrainConfig, None, ["model.vocab=96", "model.hidden=32", "model.intermediate=64",
                                                "model.layers=2", "model.heads=4", "model.kv_heads=2"])
    device = "cpu"

    model = PackedLlama(config.model, 4).to(device)
    optimizer = PackedAdamW(model, config)
    parameters = model.parameter_storage
    m, v = optimizer.first_moment_storage, optimizer.second_moment_storage
    layout = model.layout  # name, local shape, start, numel, padded_numel

    assert parameters.shape == m.shape == v.shape and parameters.shape[0] == 4
    assert layout[0].name == "model.embed_tokens.weight" and layout[0].shape == (96, 32)
    same = PackedLlama(CARD.replace(name="pretrain", max_positions=2048, eos_token_ids=(), pad_token_id=None), 4)
    assert torch.equal(same.parameter_storage, parameters)  # the group's card is the pretraining Llama's
    with pytest.raises(ValueError, match="model.vocab is null"):
        PackedLlama(load_config(PretrainConfig, None, []).model, 4)


def test_every_worker_starts_as_the_ordinary_model_and_the_arena_is_aligned():
    model = PackedLlama(CARD, 3, seed=5)
    reference = dict(ordinary(CARD, 5).named_parameters())
    for i in range(3):
        local = model.local_state_dict(i)
        assert local.keys() == reference.keys()
        assert all(torch.equal(local[k], reference[k].detach()) for k in local)
    assert all(s.start % ALIGN == 0 and s.padded_numel % ALIGN == 0 and s.padded_numel >= s.numel
               for s in model.layout)
    assert sum(s.numel for s in model.layout) == CARD.params()
    views = model.views()
    assert views["model.norm.weight"].data_ptr() == model.parameter_storage[:, model.slots["model.norm.weight"].start:].data_ptr()


def test_one_worker_trains_exactly_like_an_ordinary_model():
    """N = 1: the packed forward, local clipping and PackedAdamW equal the Decoder's
    loss_packed, clip_gradients and torch's AdamW (f32, 1e-6)."""
    from linnet.pretrain.loader import Rows

    config = _packed_config(**{"decentralized.num_models": 1})
    packed, plain = PackedLlama(CARD, 1, seed=0), ordinary(CARD, 0)
    optimizer = PackedAdamW(packed, config)
    o = config.optimizer
    reference = adamw(plain, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    for step in range(4):
        x, y = _batch(1, step)
        loss = local_mean_losses(packed, x, y)
        loss.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        row = Rows(12).from_array(torch.cat([x[0], y[0][:, -1:]], 1).numpy())
        total, count = plain.loss_packed(row)
        (total / count).backward()
        clip_gradients(list(plain.parameters()), o.grad_clip)
        reference.step()
        reference.zero_grad()
        assert float(loss[0].detach()) == pytest.approx(float(total.detach() / count), abs=1e-6)
    got = packed.local_state_dict(0)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scheme", ["awc", "atc"])
def test_each_scheme_is_local_adamw_with_mixing_before_or_after(scheme):
    """Two workers with different batches: PackedAdamW equals two ordinary models, each
    clipped on its own and stepped by torch's AdamW, their parameters mixed by the ring's
    matrix before (awc) or after (atc) the update; moments stay local."""
    config = _packed_config(**{"decentralized.scheme": scheme, "decentralized.topology": "one_peer_ring",
                               "decentralized.num_models": 3})
    packed = PackedLlama(CARD, 3, seed=1)
    optimizer = PackedAdamW(packed, config)
    plains = [ordinary(CARD, 1) for _ in range(3)]
    o = config.optimizer
    optims = [adamw(m, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay) for m in plains]

    def mix(step):
        W = mixing_matrix("one_peer_ring", 3, step)
        with torch.no_grad():
            stacked = {n: torch.stack([dict(m.named_parameters())[n] for m in plains]) for n, _ in plains[0].named_parameters()}
            for i, m in enumerate(plains):
                for n, p in m.named_parameters():
                    p.copy_(torch.einsum("j,j...->...", W[i].float(), stacked[n]))

    for step in range(3):
        x, y = _batch(3, 10 + step)
        local_mean_losses(packed, x, y).sum().backward()
        norms = []
        for i, m in enumerate(plains):
            logits = m(x[i])
            torch.nn.functional.cross_entropy(logits.reshape(-1, CARD.vocab), y[i].reshape(-1)).backward()
            norms.append(float(clip_gradients(list(m.parameters()), o.grad_clip)))
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(optimizer.local_norms, torch.tensor(norms), atol=1e-5, rtol=1e-5)
        if scheme == "awc":
            mix(step)
        for opt in optims:
            opt.step()
            opt.zero_grad()
        if scheme == "atc":
            mix(step)
    for i, m in enumerate(plains):
        got = packed.local_state_dict(i)
        for name, p in m.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), atol=1e-5, rtol=0)  # Adam steps are 3e-3
    padding = ~packed.real_mask()
    for arena in (packed.parameter_storage, optimizer.first_moment_storage, optimizer.second_moment_storage):
        assert arena.shape == packed.parameter_storage.shape and not arena.detach()[:, padding].any()


def test_complete_topology_keeps_the_workers_identical():
    """ATC with the complete topology ends every update on one global average, bit for
    bit; AWC's workers agree at each mixing event and then take their local steps."""
    packed = PackedLlama(CARD, 4, seed=2)
    optimizer = PackedAdamW(packed, _packed_config(**{"decentralized.num_models": 4, "decentralized.scheme": "atc"}))
    for step in range(3):
        local_mean_losses(packed, *_batch(4, step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        rows = packed.parameter_storage.detach()
        assert all(torch.equal(rows[0], rows[i]) for i in range(1, 4))
        assert packed.consensus_distance() == 0.0
    awc = PackedLlama(CARD, 4, seed=2)
    optimizer = PackedAdamW(awc, _packed_config(**{"decentralized.num_models": 4}))
    local_mean_losses(awc, *_batch(4, 0)).sum().backward()
    optimizer.step()
    assert awc.consensus_distance() > 0
    awc.mix_("complete", 1)
    assert awc.consensus_distance() == 0.0
    assert not torch.equal(packed.local_state_dict(0)["model.norm.weight"], ordinary(CARD, 2).model.norm.weight)


# -- topologies and adaptive consensus ----------------------------------------------------


def test_mixing_matrices_are_doubly_stochastic_and_follow_their_phases():
    for topology in ("complete", "one_peer_ring", "one_peer_exponential"):
        for n in (1, 2, 3, 4, 5, 8):
            for step in range(6):
                W = mixing_matrix(topology, n, step)
                assert torch.allclose(W.sum(0), torch.ones(n, dtype=W.dtype))
                assert torch.allclose(W.sum(1), torch.ones(n, dtype=W.dtype))
    # by hand, N = 4: the ring takes the left neighbour on even steps, the right on odd ones
    assert [[peer("one_peer_ring", 4, s, i) for i in range(4)] for s in range(4)] == [
        [3, 0, 1, 2], [1, 2, 3, 0], [3, 0, 1, 2], [1, 2, 3, 0]]
    # the exponential graph's incoming neighbour cycles through offsets 1, 2, 1, 2, ...
    assert [[peer("one_peer_exponential", 4, s, i) for i in range(4)] for s in range(4)] == [
        [3, 0, 1, 2], [2, 3, 0, 1], [3, 0, 1, 2], [2, 3, 0, 1]]
    assert [peer("one_peer_exponential", 8, s, 0) for s in range(4)] == [7, 6, 4, 7]  # offsets 1, 2, 4, 1
    W = mixing_matrix("one_peer_exponential", 4, 1)
    assert W.tolist() == [[0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5], [0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5]]
    half = mixing_matrix("one_peer_ring", 4, 0, gamma=0.25)
    assert torch.allclose(half, 0.25 * mixing_matrix("one_peer_ring", 4, 0) + 0.75 * torch.eye(4, dtype=torch.float64))
    assert torch.equal(mixing_matrix("complete", 4, 0, gamma=0.0), torch.eye(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="decentralized.topology='star'"):
        mixing_matrix("star", 4, 0)


@pytest.mark.parametrize("topology", ["complete", "one_peer_ring", "one_peer_exponential"])
def test_mix_applies_the_topologys_matrix(topology):
    model = PackedLlama(CARD, 4, seed=0)
    with torch.no_grad():
        model.parameter_storage.normal_(generator=torch.Generator().manual_seed(1))
    for step, gamma in ((0, 1.0), (1, 0.3), (2, 0.0), (3, 1.0)):
        before = model.parameter_storage.detach().double().clone()
        model.mix_(topology, step, gamma=gamma)
        expected = (mixing_matrix(topology, 4, step, gamma=gamma) @ before).float()
        torch.testing.assert_close(model.parameter_storage.detach(), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="decentralized.topology='star'"):
        model.mix_("star", 0)


def test_adaptive_consensus_gamma_at_its_edges():
    warm = lambda r: 0.1 * min(1.0, (r + 1) / 4)  # noqa: E731  warmup over 4 updates, then flat
    plan = AdaptiveConsensus.plan(start_frac=0.0, p=1.0, total=10, lr_at=warm)
    assert plan.start_step == 0 and plan.lr_max == pytest.approx(0.1)
    assert plan.gamma(0, warm(0)) == pytest.approx(0.25)  # active during warmup
    assert plan.gamma(9, warm(9)) == pytest.approx(1.0)
    late = AdaptiveConsensus.plan(start_frac=0.35, p=2.0, total=10, lr_at=lambda r: 1.0 - r / 10)
    assert late.start_step == 4 and late.lr_max == pytest.approx(0.6)  # ceil(3.5), the largest active rate
    assert late.gamma(3, 0.7) == 1.0 and late.gamma(6, 0.4) == pytest.approx((0.4 / 0.6) ** 2)
    never = AdaptiveConsensus.plan(start_frac=1.0, p=1.0, total=10, lr_at=warm)
    assert never.lr_max is None and all(never.gamma(r, warm(r)) == 1.0 for r in range(10))
    flat = AdaptiveConsensus.plan(start_frac=0.5, p=0.0, total=10, lr_at=lambda r: 0.0)
    assert flat.gamma(7, 0.0) == 1.0
    with pytest.raises(ValueError, match="learning rate is 0 over every active update"):
        AdaptiveConsensus.plan(start_frac=0.5, p=1.0, total=10, lr_at=lambda r: 0.0 if r >= 5 else 1.0)
    for bad in ("start_frac=1.5", "start_frac=.nan", "p=-1"):
        sets = ["training.accumulation=1", "decentralized.adaptive_consensus.start_frac=0.5",
                "decentralized.adaptive_consensus.p=1", f"decentralized.adaptive_consensus.{bad}"]
        with pytest.raises(ValueError, match="decentralized.adaptive_consensus"):
            load_config(PretrainConfig, None, sets)


def test_the_global_batch_rule_is_refused_with_the_numbers():
    base = ["decentralized.num_models=4", "training.context_length=1024"]
    with pytest.raises(ValueError, match="never accumulates: set training.accumulation=1"):
        load_config(PretrainConfig, None, base)
    with pytest.raises(ValueError, match=r"num_models 4 x micro_batch_size 16 x context_length 1024 = 65,536"):
        load_config(PretrainConfig, None, [*base, "training.accumulation=1", "training.global_batch_tokens=131072",
                                           "training.micro_batch_size=16"])
    config = load_config(PretrainConfig, "configs/packed4-20m-awc.yaml",
                         ["decentralized.num_models=8", "training.micro_batch_size=16"])
    assert config.decentralized.num_models == 8 and config.training.global_batch_tokens == 131072


# -- packed runs ---------------------------------------------------------------------------


def test_one_worker_runs_like_ordinary_pretraining(workspace, tmp_path):  # noqa: F811
    plain = tmp_path / "plain"
    run(_config(workspace, plain, *PACKED, "training.micro_batch_size=8"))
    one = tmp_path / "one"
    run(_config(workspace, one, *PACKED, "decentralized.num_models=1", "training.micro_batch_size=8"))
    a, b = _metrics(plain), _metrics(one)
    assert len(a) == len(b) == 32
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-6)
        assert ("held_out_loss" in x) == ("held_out_loss" in y)
        if "held_out_loss" in x:
            assert y["held_out_loss"] == pytest.approx(x["held_out_loss"], abs=1e-6)
    w1, w2 = load_file(str(plain / "final.safetensors")), load_file(str(one / "final.safetensors"))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def ring(workspace):  # noqa: F811
    """Two workers on the ring, every epoch's weights and training state kept."""
    out = workspace / "packed-ring"
    run(_config(workspace, out, *PACKED, "decentralized.num_models=2", "decentralized.topology=one_peer_ring",
                "training.checkpoint_policy=interval", "training.save_epoch_training_state=true"))
    return out


def test_a_packed_run_validates_the_average_and_exports_every_worker(ring):
    rows = _metrics(ring)
    assert len(rows) == 32 and all(len(r["local_losses"]) == 2 and r["mixing_gamma"] == 1.0 for r in rows)
    assert rows[-1]["loss"] == pytest.approx(sum(rows[-1]["local_losses"]) / 2)
    assert rows[0]["consensus_distance"] > 0  # the workers saw different batches
    held = [r["held_out_loss"] for r in rows if "held_out_loss" in r]
    assert held[-1] < held[0]
    names = sorted(p.name for p in ring.iterdir())
    assert {"node-000", "node-001", "epoch-004.safetensors", "final.safetensors"} <= set(names)
    assert sorted(p.name for p in (ring / "node-001").iterdir()) == [
        "epoch-001.safetensors", "epoch-002.safetensors", "epoch-003.safetensors", "epoch-004.safetensors",
        "final.safetensors"]
    root, w0, w1 = (load_file(str(p)) for p in (ring / "final.safetensors", ring / "node-000" / "final.safetensors",
                                                 ring / "node-001" / "final.safetensors"))
    for name in root:  # the root holds the average of the workers
        torch.testing.assert_close(root[name], (w0[name] + w1[name]) / 2, atol=1e-6, rtol=0)
    record = json.loads((ring / "run.json").read_text())
    assert record["decentralized"] == {"num_models": 2, "scheme": "awc", "topology": "one_peer_ring",
                                       "adaptive_consensus": None}
    assert record["recipe"]["fields"]["decentralized.scheme"] == "awc"
    assert json.loads((ring / "summary.json").read_text())["decentralized"] == record["decentralized"]
    snapshot = ring / "checkpoints" / "step-00000016"
    assert sorted(p.name for p in snapshot.iterdir()) == ["checksums.json", "node-000.pt", "node-001.pt",
                                                          "packed.pt", "state.pt"]
    local = torch.load(snapshot / "node-001.pt", weights_only=True)
    assert local["kind"] == "packed_worker" and local["index"] == 1 and local["step"] == 16
    assert local["model"]["model.embed_tokens.weight"].shape == (1024, 32)
    state = local["optimizer"]["state"]["model.norm.weight"]
    assert state["exp_avg"].shape == (32,) and float(state["step"]) == 16


def test_packed_resume_from_an_epoch_snapshot_is_bitwise(workspace, ring, tmp_path):  # noqa: F811
    branch = tmp_path / "branch"
    run(_config(workspace, branch, *PACKED, "decentralized.num_models=2", "decentralized.topology=one_peer_ring"),
        resume=ring / "checkpoints" / "step-00000016")
    assert [r["loss"] for r in _metrics(branch)] == [r["loss"] for r in _metrics(ring)]
    assert [r["local_losses"] for r in _metrics(branch)] == [r["local_losses"] for r in _metrics(ring)]
    for name in ("final.safetensors", "node-000/final.safetensors", "node-001/final.safetensors"):
        assert _same_weights(branch / name, ring / name)


def test_the_seeds_command_branches_from_an_epoch_and_its_snippet_inspects_a_worker(ring, tmp_path, capsys):
    """Seed 002's run layout as it writes it: `--config RUN/config.yaml --resume
    RUN/epoch-002.pt --set runtime.output_dir=BRANCH` through the CLI ends with the
    uninterrupted run's weights; its inspection snippet, with read_worker_state in place of
    torch.load and the seed's parameter name, reads the snapshot's tensors; a name no
    snapshot answers to is refused naming what the run keeps."""
    from linnet import cli
    from linnet.pretrain.decentralized_run import read_packed_state
    from linnet.pretrain.snapshots import find_checkpoint, read_worker_state

    branch = tmp_path / "branch"
    assert cli.main(["pretrain", "--config", str(ring / "config.yaml"), "--resume", str(ring / "epoch-002.pt"),
                     "--set", f"runtime.output_dir={branch}"]) == 0
    snapshot = ring / "checkpoints" / "step-00000016"
    assert json.loads((branch / "run.json").read_text())["resumed_from"] == str(snapshot)
    assert [r["local_losses"] for r in _metrics(branch)] == [r["local_losses"] for r in _metrics(ring)]
    for name in ("final.safetensors", "node-000/final.safetensors", "node-001/final.safetensors"):
        assert _same_weights(branch / name, ring / name)
    for name, step in (("epoch-002", 16), ("epoch-003.pt", 24), ("final.pt", 32), ("epoch-004.pt", 32)):
        assert find_checkpoint(ring / name) == ring / "checkpoints" / f"step-{step:08d}"

    local = read_worker_state(ring / "node-000" / "epoch-002.pt")  # the seed's torch.load(...) line
    name = "embedding.weight"
    weights = local["model"][name]
    first_moment = local["optimizer"]["state"][name]["exp_avg"]
    second_moment = local["optimizer"]["state"][name]["exp_avg_sq"]
    optimizer_step = local["optimizer"]["state"][name]["step"]
    saved = read_packed_state(snapshot)["workers"][0]
    ours = "model.embed_tokens.weight"
    assert torch.equal(weights, saved["model"][ours]) and weights.shape == (1024, 32)
    assert torch.equal(weights, load_file(str(ring / "node-000" / "epoch-002.safetensors"))[ours])  # the export
    assert torch.equal(first_moment, saved["optimizer"]["state"][ours]["exp_avg"])
    assert torch.equal(second_moment, saved["optimizer"]["state"][ours]["exp_avg_sq"])
    assert float(optimizer_step) == 16 and local["index"] == 0 and local["epoch"] == 2
    assert not torch.equal(first_moment, second_moment) and first_moment.abs().sum() > 0
    q = "layers.1.attention.q_proj.weight"  # another seed name, and linnet's own path of the file
    assert q in local["model"] and torch.equal(local["model"][q], local["model"]["model.layers.1.self_attn.q_proj.weight"])
    assert set(local["model"]) == set(saved["model"])  # one entry a tensor: linnet's paths
    last = read_worker_state(ring / "checkpoints" / "step-00000032" / "node-001.pt")
    assert torch.equal(last["model"][name], read_worker_state(ring / "node-001" / "final.pt")["model"][ours])
    assert torch.equal(last["model"][name], load_file(str(ring / "node-001" / "final.safetensors"))[ours])

    # the branch keeps epoch 3 and the final state; epoch 2 is its parent's
    capsys.readouterr()
    assert cli.main(["pretrain", "--config", str(branch / "config.yaml"), "--resume", str(branch / "epoch-002.pt"),
                     "--set", f"runtime.output_dir={tmp_path / 'twig'}"]) == 2
    err = capsys.readouterr().err
    assert f"{branch / 'epoch-002.pt'}: {branch} keeps no training-state snapshot of epoch 2" in err
    assert "it keeps epoch-003.pt, final.pt (epoch-004.pt)" in err and not (tmp_path / "twig").exists()
    with pytest.raises(FileNotFoundError, match=r"node-000/epoch-009.pt: .* no training-state snapshot of epoch 9"):
        read_worker_state(ring / "node-000" / "epoch-009.pt")
    with pytest.raises(FileNotFoundError, match=r"has no node-002.pt; it holds node-000.pt, node-001.pt"):
        read_worker_state(ring / "node-002" / "epoch-002.pt")
    with pytest.raises(ValueError, match=r"state.pt: not a packed worker file \(kind None"):
        read_worker_state(snapshot / "state.pt")


def test_damaged_or_incomplete_snapshots_and_another_scheme_are_refused_by_name(workspace, ring, tmp_path):  # noqa: F811
    from linnet.pretrain.decentralized_run import read_packed_state

    sets = (*PACKED, "decentralized.num_models=2", "decentralized.topology=one_peer_ring")
    source = ring / "checkpoints" / "step-00000016"
    assert len(read_packed_state(source)["workers"]) == 2
    with pytest.raises(ValueError, match=r"decentralized.scheme: 'awc' \(run\) vs 'atc' \(config\)"):
        run(_config(workspace, tmp_path / "atc", *sets, "decentralized.scheme=atc"), resume=source)

    def copy(name):
        target = tmp_path / name / "checkpoints" / "step-00000016"
        shutil.copytree(source, target)
        return target

    missing = copy("missing")
    (missing / "node-001.pt").unlink()
    with pytest.raises(ValueError, match="node-001.pt"):
        read_packed_state(missing)
    altered = copy("altered")  # a worker file replaced and the directory's checksums rewritten to match
    shutil.copy(ring / "checkpoints" / "step-00000008" / "node-000.pt", altered / "node-000.pt")
    sums = json.loads((altered / "checksums.json").read_text())
    from linnet.files.atomic import sha256_file

    files = sums["files"] if "files" in sums else sums
    files["node-000.pt"] = sha256_file(altered / "node-000.pt")
    (altered / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(ValueError, match=r"node-000.pt: its SHA-256 is not the one packed.pt records"):
        read_packed_state(altered)
    with pytest.raises(ValueError, match="node-000.pt"):
        run(_config(workspace, tmp_path / "from-altered", *sets), resume=altered)


def test_a_worker_export_loads_in_linnet_and_transformers(ring, tmp_path):
    transformers = pytest.importorskip("transformers")
    from linnet import nest
    from linnet.pretrain.decentralized import to_decoder

    card = Card("w", "llama", 1024, 32, 64, 2, 2, 2, 16, tied_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
    model = to_decoder(card, load_file(str(ring / "node-001" / "final.safetensors")))
    tokens = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        expected = model(tokens)
        again = nest.load(card, weights=ring / "node-001" / "final.safetensors", trainable=False, dtype="float32")
        torch.testing.assert_close(again(tokens), expected)
        model.save_weights(tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        torch.testing.assert_close(hf(tokens).logits, expected, atol=1e-5, rtol=1e-5)


def test_adaptive_consensus_in_a_run_and_its_resume(workspace, tmp_path):  # noqa: F811
    """gamma is 1 until update ceil(0.5 x 32) = 16, then lr / lr_max; the run records the
    plan, and a resume from an epoch snapshot rebuilds it (bitwise the same run). Without
    clipping the local norms are still logged."""
    sets = (*PACKED, "decentralized.num_models=2", "decentralized.topology=one_peer_exponential",
            "decentralized.adaptive_consensus.start_frac=0.5", "decentralized.adaptive_consensus.p=1",
            "optimizer.grad_clip=null")
    out = tmp_path / "adaptive"
    run(_config(workspace, out, *sets, "training.checkpoint_policy=interval", "training.save_epoch_training_state=true"))
    rows = _metrics(out)
    lr_max = max(r["lr"] for r in rows[16:])
    assert [r["mixing_gamma"] for r in rows[:16]] == [1.0] * 16
    assert [r["mixing_gamma"] for r in rows[16:]] == pytest.approx([r["lr"] / lr_max for r in rows[16:]])
    assert rows[-1]["mixing_gamma"] < 0.5 and all(n > 0 for r in rows for n in r["local_grad_norms"])
    plan = json.loads((out / "run.json").read_text())["decentralized"]["adaptive_consensus"]
    assert plan == {"total_steps": 32, "start_step": 16, "lr_max": pytest.approx(lr_max), "p": 1.0}
    branch = tmp_path / "branch"
    run(_config(workspace, branch, *sets), resume=out / "checkpoints" / "step-00000016")
    assert [r["loss"] for r in _metrics(branch)] == [r["loss"] for r in rows]
    assert [r["mixing_gamma"] for r in _metrics(branch)] == [r["mixing_gamma"] for r in rows]
    with pytest.raises(ValueError, match=r"decentralized.adaptive_consensus.p: 1.0 \(run\) vs 2.0 \(config\)"):
        run(_config(workspace, tmp_path / "other", *sets, "decentralized.adaptive_consensus.p=2"),
            resume=out / "checkpoints" / "step-00000016")


def test_gradients_land_in_one_buffer_and_accumulate_until_zero_grad():
    model = PackedLlama(CARD, 2, seed=0)
    x, y = _batch(2, 0)
    local_mean_losses(model, x, y).sum().backward()
    first = model.parameter_storage.grad.clone()
    buffer = model.parameter_storage.grad.data_ptr()
    local_mean_losses(model, x, y).sum().backward()  # no zero_grad: adds, as autograd would
    torch.testing.assert_close(model.parameter_storage.grad, 2 * first)
    model.zero_grad()
    local_mean_losses(model, x, y).sum().backward()
    assert torch.equal(model.parameter_storage.grad, first) and model.parameter_storage.grad.data_ptr() == buffer
    assert not first[:, ~model.real_mask()].any()
