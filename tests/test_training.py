"""The training package on a tiny model: data, loss, packing, resume, mesh, and export."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from training import data as data_lib
from training.config import PRESETS, build_config

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training", "data_files",
                      "codev_sample.jsonl")


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints["keqv_lm_f32_sharded"]


@pytest.fixture(scope="module")
def tokenizer(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def test_reasoning_strip():
    r = ("<think>try\n```verilog\nmodule Wrong; endmodule\n```</think><answer>Here it is:\n```verilog\n"
         "module TopModule(input a, output b);\n  assign b = a;\nendmodule\n```\nAlso\n```verilog\nx\n```</answer>")
    assert data_lib.strip_reasoning(r) == "```verilog\nmodule TopModule(input a, output b);\n  assign b = a;\nendmodule\n```"
    no_answer = "<think>hmm</think>\n```verilog\nmodule A; endmodule\n```\n```verilog\nmodule B; endmodule\n```"
    assert data_lib.strip_reasoning(no_answer) == "```verilog\nmodule A; endmodule\n```"
    assert data_lib.strip_reasoning("<think>only thoughts</think>") == ""


def test_loss_mask_is_exactly_the_assistant_turn(tokenizer):
    answer = "```verilog\nmodule TopModule(input a, output b);\n  assign b = ~a;\nendmodule\n```"
    ids, mask = data_lib.encode(tokenizer, "Invert a.", answer)
    eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert tokenizer.decode(ids[mask == 1]) == answer + "<end_of_turn>"
    assert ids[mask == 1][-1] == eot
    first = int(np.flatnonzero(mask)[0])
    assert mask[:first].sum() == 0 and ids[0] == tokenizer.bos_token_id  # prompt and BOS not learned
    assert "Invert a." in tokenizer.decode(ids[:first])
    assert mask[first:].sum() == len(mask[first:]) - (len(ids) - 1 - int(np.flatnonzero(ids == eot)[-1]))


def test_rows_over_the_cap_are_dropped_and_counted(tokenizer):
    rows = data_lib.read_rows(SAMPLE)
    enc = data_lib.encode_rows(tokenizer, rows, 256)
    assert enc.rows == 32 and enc.dropped_too_long == 1 and len(enc.examples) == 31
    assert max(len(e["tokens"]) for e in enc.examples) <= 256


def test_packing_keeps_examples_apart_and_is_deterministic(tokenizer):
    enc = data_lib.encode_rows(tokenizer, data_lib.read_rows(SAMPLE), 256)
    kw = dict(seq_len=256, batch=2, packing=True, seed=3)
    first = [b["tokens"].copy() for b in data_lib.pipeline(enc.examples, **kw)]
    again = [b["tokens"].copy() for b in data_lib.pipeline(enc.examples, **kw)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again)) and len(first) == len(again)
    other = [b["tokens"] for b in data_lib.pipeline(enc.examples, **{**kw, "seed": 4})]
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
    shared = [(b, i) for b in data_lib.pipeline(enc.examples, **kw) for i in range(len(b["tokens"]))
              if b["segment_ids"][i].max() >= 2]
    assert shared  # several examples share rows
    b, row = shared[0]
    seg, pos = b["segment_ids"][row], b["positions"][row]
    for s in range(1, seg.max() + 1):
        assert np.array_equal(pos[seg == s], np.arange((seg == s).sum()))  # positions restart per example
    m = data_lib.attention_mask(b["segment_ids"])[row]
    i, j = np.flatnonzero(seg == 2)[0], np.flatnonzero(seg == 1)[0]
    assert not m[i, j] and m[i, i]


def test_packed_loss_equals_unpacked(base, tokenizer):
    import jax
    import jax.numpy as jnp

    from ckptbridge.tunix_model import load_tunix_model
    from training.trainer import lm_loss

    jax.config.update("jax_default_matmul_precision", "highest")
    model, _ = load_tunix_model(base, param_dtype=np.float32)
    enc = data_lib.encode_rows(tokenizer, data_lib.read_rows(SAMPLE)[:8], 256)
    packed = next(b for b in data_lib.pipeline(enc.examples, seq_len=512, batch=1, packing=True, seed=0,
                                               num_packing_bins=1) if b["segment_ids"].max() >= 2)
    seg = packed["segment_ids"][0]
    n = int(seg.max())
    # the same examples, one per row, padded
    rows = []
    for s in range(1, n + 1):
        sel = seg == s
        rows.append(data_lib._pad({"tokens": packed["tokens"][0][sel], "loss_mask": packed["loss_mask"][0][sel]}, 512))
    unpacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    to_jax = lambda b: {k: jnp.asarray(v, jnp.int32) for k, v in b.items()}  # noqa: E731
    loss_p, count_p = lm_loss(model, to_jax(packed))
    loss_u, count_u = lm_loss(model, to_jax(unpacked))
    assert int(count_p) == int(count_u) > 0
    np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=2e-6)


def test_presets_and_overrides(tmp_path):
    cfg = build_config("gemma4-31b-v5p8")
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.learning_rate, cfg.warmup_steps, cfg.weight_decay) == (
        64, 64.0, 0.05, 1e-4, 100, 0.001)
    assert (cfg.micro_batch, cfg.grad_accum, cfg.max_length, cfg.checkpoint_every, cfg.keep_checkpoints) == (
        1, 8, 3072, 100, 3)
    assert (cfg.fsdp, cfg.tp, cfg.remat) == (1, 4, "decoder") and "k_einsum" in cfg.targets
    path = tmp_path / "c.yaml"
    path.write_text("rank: 4\nalpha: 8\n")
    cfg = build_config("tiny-cpu", str(path), ["learning_rate=1e-3", "packing=false", "targets=q_einsum,kv_einsum"])
    assert (cfg.rank, cfg.alpha, cfg.learning_rate, cfg.packing, cfg.targets) == (4, 8.0, 1e-3, False,
                                                                                   ("q_einsum", "kv_einsum"))
    from ckptbridge.errors import ConfigError

    for bad in (["rank=zero"], ["nope=1"], ["targets=fc1"], ["remat=some"]):
        with pytest.raises(ConfigError):
            build_config("tiny-cpu", None, bad)
    assert set(PRESETS) == {"gemma4-31b-v5p8", "tiny-cpu"}


def test_mesh_rules_are_named(base):
    from ckptbridge.config import parse_config, read_config_file
    from ckptbridge.errors import ConfigError
    from training.mesh import check_mesh

    cfg = parse_config(read_config_file(os.path.join(base, "config.json")))
    with pytest.raises(ConfigError, match="tp=4 must divide the kv heads"):
        check_mesh(1, 4, 4, cfg)  # 4 query heads, 2 kv heads
    with pytest.raises(ConfigError, match="= 2 devices, but 8 are available"):
        check_mesh(1, 2, 8, cfg)
    check_mesh(4, 1, 4, cfg)


def run_training(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_train_kill_resume_export(base, tmp_path):
    """Loss falls; a run killed mid-way resumes to the same final step over the same data;
    its checkpoint converts with no flags and PEFT matches Tunix."""
    common = ["--base", base, "--data", SAMPLE, "grad_accum=1", "micro_batch=1", "max_length=256",
              "checkpoint_every=3", "learning_rate=5e-3"]
    full = str(tmp_path / "full")
    proc = run_training("--out", full, *common)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    ref = metrics(full)
    summary = json.loads(out)
    assert summary["steps"] == len(ref) == summary["total_steps"] > 10
    assert np.mean([r["loss"] for r in ref[-3:]]) < 0.8 * np.mean([r["loss"] for r in ref[:3]])
    assert os.path.isfile(os.path.join(full, "loss.png")) and os.path.isfile(os.path.join(full, "config.json"))

    killed = str(tmp_path / "killed")
    proc = run_training("--out", killed, *common)
    deadline = time.time() + 600
    while time.time() < deadline and len(metrics(killed)) < 5 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    done = len(metrics(killed))
    assert 5 <= done < len(ref)
    proc = run_training("--out", killed, *common)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from step" in err
    got = metrics(killed)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    # the same batches in the same order: same real and loss token counts at every step
    assert [(r["tokens"], r["loss_tokens"]) for r in got] == [(r["tokens"], r["loss_tokens"]) for r in ref]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-4)

    # export with no flags, and PEFT on transformers gives the Tunix+qwix logits
    from ckptbridge.adapters import convert_orbax_to_peft
    from ckptbridge.tunix_model import load_tunix_lora_model
    from ckptbridge.verify import peft_logits, rel_l2, tunix_logits
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    adapter = str(tmp_path / "adapter")
    convert_orbax_to_peft(os.path.join(killed, "checkpoints"), adapter, base=base, progress=False)
    model, step, _ = load_tunix_lora_model(base, os.path.join(killed, "checkpoints"))
    assert step == len(ref)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 11))
    assert rel_l2(peft_logits(base, adapter, tokens), tunix_logits(model, tokens)) <= 1e-5
