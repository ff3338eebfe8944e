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
from training.trainer import read_metrics

# Gemma 4 31B's text width (benchmarks/merge_31b.py)
GEMMA4_31B = dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                  num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
                  sliding_window=1024)
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


def test_encoded_data_is_kept_for_a_resumed_run(base, tmp_path, monkeypatch):
    """A resumed run reads its token ids back (no tokenizer): equal to encoding again, and made
    again when the data, max_length or the kept file changes."""
    import shutil

    data = str(tmp_path / "rows.jsonl")
    shutil.copy(SAMPLE, data)
    cache = str(tmp_path / "encoded_data.npz")
    first = data_lib.encoded_data(base, data, 256, cache)
    calls = []
    real = data_lib.encode_rows
    monkeypatch.setattr(data_lib, "encode_rows", lambda *a: calls.append(a) or real(*a))
    again = data_lib.encoded_data(base, data, 256, cache)
    assert not calls  # read back
    assert (again.rows, again.dropped_too_long, again.dropped_empty) == (first.rows, first.dropped_too_long,
                                                                           first.dropped_empty) == (32, 1, 0)
    assert len(again.examples) == len(first.examples) == 31
    for a, b in zip(again.examples, first.examples):
        assert a["tokens"].dtype == b["tokens"].dtype and np.array_equal(a["tokens"], b["tokens"])
        assert np.array_equal(a["loss_mask"], b["loss_mask"])
    assert len(data_lib.encoded_data(base, data, 200, cache).examples) < 31 and len(calls) == 1  # max_length
    with open(data, "a") as f:  # other data
        f.write(open(SAMPLE).readline())
    assert data_lib.encoded_data(base, data, 200, cache).rows == 33 and len(calls) == 2
    with open(cache, "wb") as f:  # a damaged file is made again
        f.write(b"not npz")
    assert data_lib.encoded_data(base, data, 200, cache).rows == 33 and len(calls) == 3
    assert data_lib.encoded_data(base, data, 200, cache).rows == 33 and len(calls) == 3


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
    from training.loss import lm_loss

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


def test_lora_under_remat_and_dropout(base, tokenizer):
    """qwix LoRA on a rematerialised Tunix model (Tunix's remat=decoder and block, and
    the per-layer policies of training/remat.py) gets its factors, and with dropout on, gradients
    equal those without remat for the same masks; the policies keep the parameter paths."""
    import jax
    from flax import nnx

    from ckptbridge.formats.qwix import dropout_rngs, reseed
    from ckptbridge.specs import GEMMA4
    from ckptbridge.tunix_model import open_tunix_model
    from training import step as step_lib
    from training.remat import REMAT, tunix_remat
    from training.loss import lm_loss

    jax.config.update("jax_default_matmul_precision", "highest")
    enc = data_lib.encode_rows(tokenizer, data_lib.read_rows(SAMPLE)[:6], 256)
    batch = next(iter(data_lib.pipeline(enc.examples, seq_len=256, batch=2, packing=True, seed=0)))
    batch = {k: jax.numpy.asarray(v, jax.numpy.int32) for k, v in batch.items()}
    grads, paths = {}, {}
    for remat in REMAT:
        cfg = build_config("tiny-cpu", None, ["dropout=0.1", f"remat={remat}", "loss_chunk=64"])
        rules = [dict(r, dropout=cfg.dropout) for r in cfg.lora_rules(GEMMA4.lora_targets)]
        with open_tunix_model(base, param_dtype=np.float32, remat=tunix_remat(remat), lora_rules=rules) as plan:
            model = step_lib.for_training(plan.load(), cfg, plan.model_config)
        state = nnx.state(model, nnx.LoRAParam)
        paths[remat] = [p for p, _ in nnx.to_flat_state(state)]
        assert len(paths[remat]) == 72  # 6 layers x 7 targets x (A, B), k_einsum on the global one
        # non-zero B so that dropout reaches the loss
        nnx.update(model, jax.tree.map(lambda x: x + 0.01, state))
        rngs = dropout_rngs(model)
        grad_fn = nnx.grad(lambda m: lm_loss(m, batch, cfg.loss_chunk)[0], argnums=nnx.DiffState(0, nnx.LoRAParam))
        flat = lambda g: np.concatenate([np.ravel(v.get_value()) for _, v in nnx.to_flat_state(g)])  # noqa: E731
        reseed(rngs, cfg.seed, 0)
        first = flat(grad_fn(model))
        if remat in ("none", "decoder_dots"):  # without remat, and under one of our policies
            reseed(rngs, cfg.seed, 1)
            other = flat(grad_fn(model))
            reseed(rngs, cfg.seed, 0)
            assert np.array_equal(first, flat(grad_fn(model)))  # masks depend on (seed, micro-batch) only
            assert not np.allclose(first, other)  # and change between micro-batches
        grads[remat] = first
    for remat in REMAT:  # same maths, other fusion: float32 rounding apart
        assert paths[remat] == paths["none"], remat
        assert np.linalg.norm(grads[remat] - grads["none"]) <= 1e-5 * np.linalg.norm(grads["none"]), remat


def test_lora_from_the_plan_equals_qwix_on_the_loaded_model(base):
    """A model planned with LoRA rules (its factors initialised by one compiled program) holds the
    same base weights and the same initial factors, bit for bit, as qwix applied to the loaded
    model op by op (the seed decides them either way), and the same model structure."""
    from flax import nnx

    from ckptbridge.specs import GEMMA4
    from ckptbridge.tunix_model import apply_lora_rules, load_tunix_model, open_tunix_model

    rules = [dict(r, dropout=0.05) for r in build_config("tiny-cpu", None, []).lora_rules(GEMMA4.lora_targets)]
    eager = apply_lora_rules(load_tunix_model(base, param_dtype=np.float32)[0], rules, seed=3)
    with open_tunix_model(base, param_dtype=np.float32, lora_rules=rules, seed=3) as plan:
        planned = plan.load(workers=3, memory_budget=4096)  # several threads, pieces over the budget
    a, b = dict(nnx.to_flat_state(nnx.state(eager))), dict(nnx.to_flat_state(nnx.state(planned)))
    assert a.keys() == b.keys() and len(a) == 152
    for path in a:
        assert np.array_equal(np.asarray(a[path].get_value()), np.asarray(b[path].get_value())), path
    assert type(planned).__mro__[1] is type(eager).__mro__[1]  # qwix's wrapper of the same Tunix class


def _lora_model(src, rank=8):
    import jax
    from flax import nnx

    from ckptbridge.specs import GEMMA4
    from ckptbridge.tunix_model import apply_lora_rules, keep_hidden_states, load_tunix_model

    model, _ = load_tunix_model(src, param_dtype=np.float32)
    rules = build_config("tiny-cpu", None, [f"rank={rank}"]).lora_rules(GEMMA4.lora_targets)
    model = apply_lora_rules(model, rules)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda x: x + 0.01, state))  # non-zero B: every factor gets a gradient
    return keep_hidden_states(model)


def _loss_and_grads(model, chunk):
    """jit(value_and_grad) of the training loss over the LoRA factors, as a pure function."""
    import jax
    from flax import nnx

    from training.loss import lm_loss

    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    fn = jax.jit(jax.value_and_grad(lambda lora, rest, batch: lm_loss(nnx.merge(graphdef, lora, rest), batch,
                                                                      chunk)[0]))
    return fn, lora, rest


def test_loss_in_chunks_equals_the_plain_loss(base, tokenizer):
    """The loss over the output head in sequence chunks (loss_chunk, default 512) gives the loss
    and LoRA gradients of the plain form (full logits) to 1e-6 relative, on packed data whose
    length is no multiple of the chunk."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    model = _lora_model(base)
    enc = data_lib.encode_rows(tokenizer, data_lib.read_rows(SAMPLE)[:8], 256)
    batch = next(iter(data_lib.pipeline(enc.examples, seq_len=300, batch=2, packing=True, seed=0)))
    batch = {k: jax.numpy.asarray(v, jax.numpy.int32) for k, v in batch.items()}
    results = {}
    for chunk in (0, 64, 512):
        fn, lora, rest = _loss_and_grads(model, chunk)
        loss, grads = fn(lora, rest, batch)
        results[chunk] = float(loss), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    loss0, grads0 = results[0]
    assert np.isfinite(loss0) and np.linalg.norm(grads0) > 0
    for chunk in (64, 512):
        loss, grads = results[chunk]
        assert abs(loss - loss0) <= 1e-6 * abs(loss0), chunk
        assert np.linalg.norm(grads - grads0) <= 1e-6 * np.linalg.norm(grads0), chunk


@pytest.mark.pinned_only
def test_loss_in_chunks_memory_does_not_grow_with_vocab_times_sequence(tmp_path):
    """XLA's own figure for the compiled loss-and-gradient program (temporary buffers): doubling a
    wide vocab adds at least one batch x sequence x vocab float32 array to the plain form, and
    in chunks of 64 a few batch x 64 x vocab ones (less than half of the former)."""
    import jax

    from ckptbridge.testing import build_checkpoint

    b, t = 2, 1024
    batch = {"tokens": np.arange(b * t).reshape(b, t) % 300, "segment_ids": np.ones((b, t)),
             "positions": np.tile(np.arange(t), (b, 1)), "loss_mask": np.ones((b, t))}
    batch = {k: jax.numpy.asarray(v, jax.numpy.int32) for k, v in batch.items()}
    temp = {}
    for vocab in (16384, 32768):
        src = build_checkpoint(str(tmp_path / f"v{vocab}"), family="gemma4", dtype="float32", seed=1,
                               vocab_size=vocab, tokenizer=False)
        model = _lora_model(src, rank=4)
        for chunk in (0, 64):
            fn, lora, rest = _loss_and_grads(model, chunk)
            temp[vocab, chunk] = fn.lower(lora, rest, batch).compile().memory_analysis().temp_size_in_bytes
    logits = b * t * 16384 * 4  # the float32 logits added by doubling the vocab
    assert temp[32768, 0] - temp[16384, 0] >= logits, temp
    assert temp[32768, 64] - temp[16384, 64] < logits / 2, temp
    assert temp[32768, 64] < temp[32768, 0] / 2, temp


# XLA's memory analysis of the train step at a width, compiled from shapes alone (training.step.analyze)
MEMORY_ANALYSIS = r"""
import json, sys
import jax, numpy as np
from jax.sharding import Mesh
from ckptbridge import testing
from ckptbridge.specs import get_family
from training.config import build_config
from training import step
layers, width, overrides = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
types = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
spec = get_family("gemma4")
model_cfg = spec.parse_config(testing.hf_config("gemma4", prefix="model.", num_hidden_layers=layers, layer_types=types,
                                                **width), "config.json")
cfg = build_config("gemma4-31b-v5p8", None, ["tp=1", "grad_accum=1", *overrides])
mesh = Mesh(np.asarray(jax.devices()).reshape(1, 1), ("fsdp", "tp"))
programs, plan = step.analyze(model_cfg, cfg, mesh, cfg.lora_rules(spec.lora_targets))
print(json.dumps({"weights": plan.weights_bytes(), **programs.memory["train_grad_step"]}))
"""


def step_memory(layers: int, *overrides: str, width: dict | None = None) -> dict:
    """The grad step's memory analysis (bytes) for a Gemma 4 of ``layers`` layers at ``width``
    (default 31B's), compiled on the CPU. XLA:CPU expands the optimization barriers that keep a
    rematerialised forward apart from the original before it eliminates common subexpressions, so
    that remat saves nothing there (TPU and GPU keep them to the end); the pass is switched off
    here so that the CPU's analysis counts what a TPU's does. bfloat16 weights get float32 copies
    on the CPU (it has no bfloat16 products), so the CPU analysis runs in float32."""
    proc = subprocess.run([sys.executable, "-c", MEMORY_ANALYSIS, str(layers), json.dumps(width or GEMMA4_31B),
                           "param_dtype=float32", "dtype=float32", *overrides], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                            "XLA_FLAGS": "--xla_disable_hlo_passes=cse_barrier_expander"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.pinned_only
def test_memory_of_one_decoder_layer_at_31b_width():
    """At Gemma 4 31B's width and 3072 tokens (rank 64 on every projection), from XLA's memory
    analysis of the compiled grad step (no weight allocated): under remat=decoder each added
    decoder layer adds at most 0.25 GB beyond its weights (it keeps its input, 3072 x 5376
    values), and no program returns or copies a weight (the step held a copy of every base weight
    in its outputs); decoder_dots keeps the layer's projections (about (q + kv + o + 2F + D) x 3072
    values), which shows that the analysis sees what a layer keeps for the backward pass.

    QLoRA (base_quant=int4, remat=decoder): the layer's weights as XLA holds them (its argument
    bytes: 4-bit values packed two to a byte, their scales, the LoRA factors and their gradient sums)
    take at most 0.3x of the bf16 step's (the float32 step's, its weights at two bytes a value).
    XLA:CPU's temporaries then grow by a float32 dequantized weight a layer, for every scheme alike
    (0.45 GB), which a TPU's compiler does not keep: the whole cost a layer adds on a v6e chip (0.263x
    of bf16's) is benchmarks/qlora_memory.py's, ahead of time with libtpu."""
    beyond, layer = {}, {}
    for remat in ("decoder", "decoder_dots"):
        two, three = step_memory(2, f"remat={remat}"), step_memory(3, f"remat={remat}")
        for m in (two, three):
            assert m["output"] - m["alias"] < 0.2e9, (remat, m)  # LoRA gradients and scalars only
        beyond[remat] = (three["temp"] + three["output"]) - (two["temp"] + two["output"])
        layer[remat] = {k: three[k] - two[k] for k in ("weights", "argument", "temp")}
    gb = {k: round(v / 1e9, 3) for k, v in beyond.items()}
    assert beyond["decoder"] <= 0.25e9, gb
    kept = (8192 + 2 * 4096 + 5376 + 2 * 21504 + 5376) * 3072 * 4  # q, k+v, o, gate+up, down: float32
    assert 0.8 * kept <= beyond["decoder_dots"] - beyond["decoder"] <= 1.3 * kept, gb

    two, three = step_memory(2, "remat=decoder", "base_quant=int4"), step_memory(3, "remat=decoder", "base_quant=int4")
    int4 = {k: three[k] - two[k] for k in ("weights", "argument", "temp")}
    plain = layer["decoder"]
    lora = plain["argument"] - plain["weights"]  # the layer's LoRA factors and their gradient sums
    assert int4["weights"] * 3.9 <= plain["weights"] / 2 <= int4["weights"] * 4.1, (int4, plain)  # all of it in 4 bits
    assert int4["argument"] <= 0.3 * (plain["weights"] / 2 + lora), (int4, plain)
    assert int4["argument"] - int4["weights"] == lora, (int4, plain)


@pytest.mark.parametrize("name", ["keqv_lm_f32_sharded", "gemma4_e2b", "qwen3_moe", "qwen3_untied", "llama3_tied",
                                  "gemma_fused"])
def test_model_flops_count_every_matmul_weight_of_the_files(checkpoints, name):
    """The matmul parameters behind the MFU figure equal a count over the safetensors files
    themselves: every tensor of two or more axes but the embedding tables, experts at top_k of
    num_experts, plus the output head (vocab x hidden, tied or not)."""
    import glob

    from safetensors import safe_open

    from ckptbridge.lora.base import open_base
    from training import throughput

    src = checkpoints[name]
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config") or config
    experts, top_k = text.get("num_experts") or text.get("num_local_experts"), text.get("num_experts_per_tok")
    count = text["vocab_size"] * text["hidden_size"]
    for path in glob.glob(os.path.join(src, "*.safetensors")):
        with safe_open(path, "np") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                if len(shape) < 2 or "embed_tokens" in key or key == "lm_head.weight":
                    continue
                n = int(np.prod(shape))
                count += n * top_k / experts if ".experts." in key else n
    b = open_base(src)
    flops = throughput.lora_step_flops(b.cfg, b.spec, 1024, lora_params=1000)
    assert flops.matmul_params == count
    assert flops.weights == 4 * count and flops.lora == 6000 and flops.attention > 0


def test_chip_peaks():
    from training import throughput

    assert throughput.chip_peak_tflops("TPU v5p") == 459 and throughput.chip_peak_tflops("TPU v6 lite") == 918
    assert throughput.chip_peak_tflops("TPU v5 lite") == 197
    assert throughput.chip_peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert throughput.chip_peak_tflops("NVIDIA H200") == 989
    assert throughput.chip_peak_tflops("cpu") is None
    assert throughput.mfu(1e9, 1000.0, 4, 459.0) == pytest.approx(1e12 / (4 * 459e12))
    assert throughput.mfu(1e9, 1000.0, 1, None) is None


def test_presets_and_overrides(tmp_path):
    cfg = build_config("gemma4-31b-v5p8")
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.learning_rate, cfg.warmup_steps, cfg.weight_decay) == (
        64, 64.0, 0.05, 1e-4, 100, 0.001)
    assert (cfg.micro_batch, cfg.grad_accum, cfg.max_length, cfg.checkpoint_every, cfg.keep_checkpoints) == (
        1, 8, 3072, 100, 3)
    assert (cfg.fsdp, cfg.tp, cfg.remat) == (1, 4, "decoder_dots") and "k_einsum" in cfg.targets
    path = tmp_path / "c.yaml"
    path.write_text("rank: 4\nalpha: 8\n")
    cfg = build_config("tiny-cpu", str(path), ["learning_rate=1e-3", "packing=false", "targets=q_einsum,kv_einsum"])
    assert (cfg.rank, cfg.alpha, cfg.learning_rate, cfg.packing, cfg.targets) == (4, 8.0, 1e-3, False,
                                                                                   ("q_einsum", "kv_einsum"))
    from ckptbridge.errors import ConfigError

    for bad in (["rank=zero"], ["nope=1"], ["targets=fc1"], ["remat=some"]):
        with pytest.raises(ConfigError):
            build_config("tiny-cpu", None, bad)
    assert set(PRESETS) == {"gemma4-31b-v5p8", "gemma4-31b-v6e1-qlora", "gemma4-31b-v5e4-qlora", "tiny-cpu"}


def test_mesh_rules_are_named(base):
    from ckptbridge.config import read_config_file
    from ckptbridge.specs import parse_config
    from ckptbridge.errors import ConfigError
    from training.mesh import check_mesh

    cfg = parse_config(read_config_file(os.path.join(base, "config.json")))
    with pytest.raises(ConfigError, match="tp=4 must divide the kv heads"):
        check_mesh(1, 4, 4, cfg)  # 4 query heads, 2 kv heads
    with pytest.raises(ConfigError, match="= 2 devices, but 8 are available"):
        check_mesh(1, 2, 8, cfg)
    check_mesh(4, 1, 4, cfg)


class TrainingProcess:
    """``python -m training --preset tiny-cpu`` with its output in files, not pipes: a run the test
    polls and kills without reading it never blocks on a full pipe (jaxlib 0.10.0 logs two lines
    for each program it loads from the compilation cache, hundreds on a resume)."""

    def __init__(self, args, env=None, preset="tiny-cpu"):
        import tempfile

        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "training", "--preset", preset, "--quiet", *args],
                                     stdout=self._out, stderr=self._err, text=True,
                                     env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})

    @property
    def returncode(self):
        return self.proc.returncode

    def poll(self):
        return self.proc.poll()

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def communicate(self, timeout=None):
        self.proc.wait(timeout=timeout)
        outputs = []
        for f in (self._out, self._err):
            f.seek(0)
            outputs.append(f.read())
            f.close()
        return tuple(outputs)


def run_training(*args, env=None, preset="tiny-cpu"):
    return TrainingProcess(args, env, preset)


def metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    return read_metrics(path)  # whole lines: the run may be writing one


@pytest.mark.slow
def test_four_device_mesh_trains_like_one_device(tmp_path):
    """tp=4 over 4 simulated CPU devices: LoRA factors sharded, the same losses and the same
    adapter as on one device; LoRA dropout runs on the mesh too."""
    from ckptbridge.testing import build_checkpoint

    base = build_checkpoint(str(tmp_path / "hf"), num_attention_heads=8, num_key_value_heads=4,
                            num_global_key_value_heads=4)
    common = ["--base", base, "--data", SAMPLE, "--max-steps", "3", "max_length=256", "log_every=1"]
    four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
                         "--xla_cpu_collective_call_terminate_timeout_seconds=120"}
    runs = {}
    for name, extra, env in (("one", [], None), ("four", ["tp=4"], four), ("dropout", ["tp=4", "dropout=0.05"], four)):
        out = str(tmp_path / name)
        proc = run_training("--out", out, *common, *extra, env=env)
        stdout, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        runs[name] = (out, metrics(out), err)
        assert_one_compile_per_run(json.loads(stdout), runs[name][1])  # on the mesh too
    log = runs["four"][2]
    assert "mesh {'fsdp': 1, 'tp': 4}" in log
    sharded, total = (int(x) for x in log.split("LoRA factors: ")[1].split(" sharded")[0].split(" of "))
    assert total == 72 and sharded > 0  # 6 layers x 7 targets (k_einsum on the global one) x (A, B)
    one, four_m = runs["one"][1], runs["four"][1]
    assert [r["step"] for r in four_m] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in four_m], [r["loss"] for r in one], rtol=1e-4)
    np.testing.assert_allclose([r["grad_norm"] for r in four_m], [r["grad_norm"] for r in one], rtol=1e-3)
    drop = runs["dropout"][1]
    assert len(drop) == 3 and all(np.isfinite(r["loss"]) for r in drop)
    # B starts at zero, so step 1's loss is the same, but dropout changes the gradients
    assert drop[0]["loss"] == four_m[0]["loss"] and abs(drop[0]["grad_norm"] / four_m[0]["grad_norm"] - 1) > 1e-3

    from safetensors.numpy import load_file

    from ckptbridge import convert_orbax_to_peft

    tensors = {}
    for name in ("one", "four"):
        dst = str(tmp_path / f"{name}-adapter")
        convert_orbax_to_peft(os.path.join(runs[name][0], "checkpoints"), dst, base=base, progress=False)
        tensors[name] = load_file(os.path.join(dst, "adapter_model.safetensors"))
    assert tensors["one"].keys() == tensors["four"].keys()
    for key, value in tensors["one"].items():
        np.testing.assert_allclose(tensors["four"][key], value, rtol=1e-3, atol=1e-5, err_msg=key)


def test_dry_run_from_the_config_alone(base, tmp_path):
    """``--dry-run`` on a directory holding nothing but the base's config.json: the step programs
    compiled from shapes, their memory per device as JSON, nothing written; here (a CPU) the
    device's memory is not known. ``--topology`` without ``--dry-run``, or a name that is no TPU
    slice: one line, exit code."""
    import shutil

    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(os.path.join(base, "config.json"), only / "config.json")
    run = [sys.executable, "-m", "training", "--preset", "tiny-cpu", "--base", str(only), "--dry-run"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([*run, "max_length=128"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    grad = report["programs"]["train_grad_step"]
    assert grad["argument"] >= report["weights_bytes"] > 0 and grad["temp"] > 0 and grad["peak_bytes"] > grad["temp"]
    assert report["fits"] is None and report["device_memory_bytes"] is None and report["max_length"] == 128
    assert "training: the step needs" in r.stderr.splitlines()[-1] and os.listdir(only) == ["config.json"]
    bad = subprocess.run([*run[:-1], "--topology", "v5p:2x2x1"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "use it with --dry-run" in bad.stderr
    bad = subprocess.run([*run, "--topology", "v5p-8"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 8 and bad.stderr.strip().splitlines()[-1].startswith("training: error: --topology v5p-8")


def assert_one_compile_per_run(summary: dict, records: list[dict]) -> None:
    """Both step programs compiled once, before the first step; no step compiled anything (a
    step that compiles, e.g. from other argument types or shardings than the programs were
    compiled for, shows as compiles > 0)."""
    programs = summary["programs"]
    for name in ("jit(train_grad_step)", "jit(train_apply_step)"):
        assert programs[name]["compiles"] == 1 and programs[name]["seconds"] > 0, programs
    assert [(r["step"], r.get("compiled_programs")) for r in records if r["compiles"]] == [], records


@pytest.mark.slow
def test_one_compile_per_run_with_the_31b_recipe(base, tmp_path):
    """The 31B preset's path (bfloat16, LoRA dropout, remat=decoder_dots, the loss in chunks,
    gradient accumulation) on the tiny model: nothing compiles at any step (it compiled the
    optimizer update again at step 2, when its moments turned from bfloat16 to float32)."""
    out = str(tmp_path / "run")
    proc = run_training("--out", out, "--base", base, "--data", SAMPLE, "--max-steps", "3", "tp=1", "grad_accum=2",
                        "max_length=256", "checkpoint_every=100", preset="gemma4-31b-v5p8")
    stdout, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    summary, records = json.loads(stdout), metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)
    assert_one_compile_per_run(summary, records)
    memory = summary["memory"]
    assert memory["programs"]["train_grad_step"]["temp"] > 0 and memory["weights_bytes"] > 0
    assert summary["load_seconds"] > 0 and summary["programs"]["jit(init_lora_factors)"]["compiles"] == 1


@pytest.mark.slow
@pytest.mark.pinned_only
def test_kills_resume_and_export(base, tokenizer, tmp_path):
    """Loss falls over a full run. A run with a checkpoint every step, SIGKILLed three times right
    after a step's metrics line (inside the save that follows) or mid-step: every resume restores a
    committed checkpoint, the run ends at the same step with the same batches and losses, every
    row's loss tokens are counted exactly once in the epoch, and its checkpoint converts with no
    flags into a PEFT adapter that matches Tunix."""
    import random

    common = ["--base", base, "--data", SAMPLE, "grad_accum=1", "micro_batch=1", "max_length=256",
              "learning_rate=5e-3"]
    ref_dir = str(tmp_path / "ref")
    proc = run_training("--out", ref_dir, *common, "checkpoint_every=3")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    ref = metrics(ref_dir)
    summary = json.loads(out)
    assert summary["steps"] == len(ref) == summary["total_steps"] > 10
    # the step programs compile once per run, before the first step, and no step compiles anything;
    # the programs' counts > 0 also say JAX's compile events are still seen (training/compiles.py)
    assert_one_compile_per_run(summary, ref)
    assert np.mean([r["loss"] for r in ref[-3:]]) < 0.8 * np.mean([r["loss"] for r in ref[:3]])
    assert os.path.isfile(os.path.join(ref_dir, "loss.png")) and os.path.isfile(os.path.join(ref_dir, "config.json"))

    common += ["checkpoint_every=1", "keep_checkpoints=2"]
    rng = random.Random(7)
    run_dir = str(tmp_path / "killed")
    ckpts = os.path.join(run_dir, "checkpoints")
    targets = sorted(rng.sample(range(2, len(ref) - 2), 3))
    for target in targets:
        proc = run_training("--out", run_dir, *common)
        deadline = time.time() + 600
        while time.time() < deadline and len(metrics(run_dir)) < target and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))  # into the checkpoint save, or the next step
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        assert len(metrics(run_dir)) < len(ref)
        for name in os.listdir(ckpts):  # committed steps are whole; anything else is Orbax's temporary
            path = os.path.join(ckpts, name)
            if name.isdigit():
                assert os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA")), os.listdir(path)
    proc = run_training("--out", run_dir, *common)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from step" in err
    got = metrics(run_dir)
    # the resumed session's step programs come from RUN_DIR/compile_cache
    programs = json.loads(out)["programs"]
    assert programs["jit(train_grad_step)"]["cache_hits"] == 1 and programs["jit(train_apply_step)"]["cache_hits"] == 1
    assert os.listdir(os.path.join(run_dir, "compile_cache"))
    assert not [r["step"] for r in got if r["compiles"]]
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    # the same batches in the same order: same real and loss token counts at every step
    assert [(r["tokens"], r["loss_tokens"]) for r in got] == [(r["tokens"], r["loss_tokens"]) for r in ref]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-4)
    # one epoch: each example's loss tokens (after the first position) counted once
    enc = data_lib.encode_rows(tokenizer, data_lib.read_rows(SAMPLE), 256)
    assert sum(r["loss_tokens"] for r in got) == sum(int(e["loss_mask"][1:].sum()) for e in enc.examples)

    # export with no flags, and PEFT on transformers gives the Tunix+qwix logits
    from ckptbridge import convert_orbax_to_peft
    from ckptbridge.tunix_model import load_tunix_lora_model
    from ckptbridge.verify import peft_logits, rel_l2, tunix_logits
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    adapter = str(tmp_path / "adapter")
    convert_orbax_to_peft(ckpts, adapter, base=base, progress=False)
    model, step, _ = load_tunix_lora_model(base, ckpts)
    assert step == len(ref)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 11))
    assert rel_l2(peft_logits(base, adapter, tokens), tunix_logits(model, tokens)) <= 1e-5
