"""``python -m serving watch``: score every checkpoint of a training run on the serving stack as it lands.

One vLLM server for the whole run (runtime LoRA loading): each committed checkpoint of the run's
Tunix ``CheckpointManager`` directory is exported to a ``--target vllm`` PEFT adapter, linted,
loaded into the server, checked against transformers + PEFT (greedy ids on a few prompts), and
scored on the problems (``eval generate`` + ``eval score``); one row per checkpoint goes to
``OUT/watch.jsonl``. Restartable: a step with a row is never scored again; the samples of a step
cut short are resumed.

Layout of OUT: ``watch.jsonl`` (rows), ``best.json``, ``watch.png``, ``adapters/step-N``,
``samples/step-N.jsonl``, ``scores/step-N.json``, ``server.log``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

from ckptbridge.errors import InputNotFoundError
from ckptbridge.io import storage
from serving.server import ServerError

ROWS = "watch.jsonl"
BEST = "best.json"
PLOT = "watch.png"
# Orbax's CheckpointManager finalizes a step, once every item is written, by setting
# commit_timestamp_nsecs in its _CHECKPOINT_METADATA and writing commit_success.txt; on a local disk
# it then renames <step>.orbax-checkpoint-tmp-<n> to <step>, on Cloud Storage (and GCSFuse) the step is
# written in place, its metadata there from the start: either marker, not the directory, says committed
COMMIT_FILE = "commit_success.txt"
METADATA = "_CHECKPOINT_METADATA"
ITEM = "model_params"
LIVE = "live"  # the lint's check that an adapter changes something
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
LOCK = "watch.lock"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint of the run: its step, its directory and when it was committed."""

    step: int
    path: str
    committed: float  # time.time() of its commit file


def checkpoints_dir(run_dir: str) -> str:
    """The checkpoint-manager directory of a training run (``RUN_DIR/checkpoints``, local or
    ``gs://``); an InputNotFoundError (exit 3) for a directory that is not a training run."""
    if not storage.isdir(run_dir):
        raise InputNotFoundError(f"{run_dir}: no such directory; give the RUN_DIR of `python -m training`")
    root = storage.join(run_dir, "checkpoints")
    if not storage.isfile(storage.join(run_dir, "config.json")) and not storage.isdir(root):
        raise InputNotFoundError(f"{run_dir}: not a training run (no config.json and no checkpoints/); give the "
                                 "RUN_DIR of `python -m training`")
    return root


def _commit_time(step_dir: str) -> float | None:
    """When the step was committed (time.time() scale), None while it is not."""
    try:
        meta = json.loads(storage.read_bytes(storage.join(step_dir, METADATA)))
    except (OSError, ValueError):
        meta = {}
    stamp = meta.get("commit_timestamp_nsecs") if isinstance(meta, dict) else None
    if isinstance(stamp, int) and stamp > 0:
        return stamp / 1e9
    marker = storage.join(step_dir, COMMIT_FILE)
    if storage.is_remote(step_dir):
        return time.time() if storage.isfile(marker) else None  # (Orbax stamps the metadata too)
    try:
        return os.stat(marker).st_mtime
    except FileNotFoundError:
        return None


def committed(root: str, skip: frozenset[int] | set[int] = frozenset()) -> list[Checkpoint]:
    """The run's committed checkpoints with the LoRA item, by step (steps in ``skip`` not looked at);
    Orbax's temporary directories and steps still being written are left out."""
    try:
        names = storage.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        if not name.isdigit() or int(name) in skip:
            continue
        step = storage.join(root, name)
        try:
            when = _commit_time(step)
            if when is not None and storage.isdir(storage.join(step, ITEM)):
                found.append(Checkpoint(int(name), step, when))
        except FileNotFoundError:  # removed by the run's retention meanwhile
            continue
    return sorted(found, key=lambda c: c.step)


def loss_at(metrics_path: str, step: int) -> float | None:
    """The training loss the run logged at ``step`` (whole lines of metrics.jsonl only), None if none."""
    try:
        text = storage.read_bytes(metrics_path).decode()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    for line in text[: text.rfind("\n") + 1].splitlines():  # not a line being written
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step") == step and isinstance(record.get("loss"), (int, float)):
            return float(record["loss"])
    return None


def whole_lines(path: str) -> str:
    """The text of a jsonl file that this process or a killed one appends to, up to its last whole
    line; a partly written last line (a kill mid-write) is cut from the file, atomically."""
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        text = f.read()
    whole = text[: text.rfind("\n") + 1]
    if whole != text:
        _replace(path, whole)
    return whole


def _replace(path: str, text: str) -> None:
    """Write ``path`` whole: a reader (or a watch started after a kill) sees the old text or the new."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Rows:
    """``OUT/watch.jsonl``: one row per scored step, appended whole (a line and fsync), read back
    on restart (a partly written last line is dropped)."""

    def __init__(self, out: str):
        self.path = os.path.join(out, ROWS)
        self.rows: list[dict] = [json.loads(line) for line in whole_lines(self.path).splitlines() if line.strip()]

    @property
    def steps(self) -> set[int]:
        return {r["step"] for r in self.rows}

    def append(self, row: dict) -> None:
        if row["step"] in self.steps:
            raise RuntimeError(f"step {row['step']} has a row already")
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)


def best(rows: list[dict], k: int = 1) -> dict | None:
    """The best row: highest pass@k (``k``: 1), ties to the lower training loss, then the earlier step."""
    scored = [r for r in rows if r.get(f"pass@{k}") is not None]
    if not scored:
        return None

    def key(r):
        loss = r.get("loss")
        return (-r[f"pass@{k}"], loss if loss is not None else float("inf"), r["step"])

    return min(scored, key=key)


def write_best(out: str, rows: list[dict]) -> dict | None:
    row = best(rows)
    if row is None:
        return None
    record = {"step": row["step"], "adapter": row["adapter"], "pass@1": row["pass@1"], "loss": row.get("loss"),
              "chosen_by": "pass@1, ties to the lower training loss"}
    _replace(os.path.join(out, BEST), json.dumps(record, indent=2) + "\n")
    return record


def plot(out: str, rows: list[dict], ks: tuple[int, ...]) -> str | None:
    """``OUT/watch.png``: pass@k (left axis) and the training loss (right) against step."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["step"])
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for k in ks:
        ax.plot(steps, [r.get(f"pass@{k}") for r in rows], marker="o", label=f"pass@{k}")
    ax.set_xlabel("training step")
    ax.set_ylabel("pass@k")
    ax.set_ylim(-0.03, 1.03)  # 0 and 1 stay visible
    ax.grid(alpha=0.3)
    losses = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    if losses:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in losses], [v for _, v in losses], color="gray", ls="--", marker=".", label="loss")
        ax2.set_ylabel("training loss")
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("checkpoints scored as they land")
    fig.tight_layout()
    path = os.path.join(out, PLOT)
    fig.savefig(path)
    plt.close(fig)
    return path


def pending(root: str, done: set[int]) -> list[Checkpoint]:
    """Committed checkpoints without a row, oldest first."""
    return committed(root, skip=done)


class ServerGone(ServerError):
    """The vLLM server stopped answering (exit 9; the rows written so far stay)."""


class LoraServer:
    """A running vLLM (OpenAI API) that takes LoRA adapters at run time: ``load`` / ``unload`` through
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (the server started with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _post(self, path: str, body: dict) -> None:
        import httpx

        try:
            r = httpx.post(f"{self.url}{path}", json=body, timeout=300)
        except httpx.TransportError as e:
            raise ServerGone(f"the server at {self.url} went away ({type(e).__name__})") from None
        if r.status_code != 200:
            from ckptbridge.errors import ConfigError

            hint = ("; the server must take adapters at run time (`python -m serving serve --runtime-lora`; the one "
                    "`watch` starts does)" if r.status_code in (404, 405) else "")
            raise ConfigError(f"{self.url}{path} answered {r.status_code}: {r.text.strip()[:300]}{hint}")

    def load(self, name: str, path: str) -> None:
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": os.path.abspath(path)})

    def unload(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def models(self) -> list[str]:
        import httpx

        try:
            r = httpx.get(f"{self.url}/v1/models", timeout=30)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ServerGone(f"the server at {self.url} went away ({type(e).__name__})") from None
        return [m["id"] for m in r.json().get("data", [])]


@dataclasses.dataclass
class Watch:
    """What one watch needs: the run, the base model, the problems, where to write, how to score."""

    run_dir: str
    base: str
    problems: str
    out: str
    samples: int = 5
    keep: int = 2
    ks: tuple[int, ...] = (1, 5)
    temperature: float = 0.8
    max_tokens: int = 1024
    parity_tokens: int = 8
    say: Callable[[str], None] = print

    @property
    def root(self) -> str:
        return storage.join(self.run_dir, "checkpoints")

    def adapter_dir(self, step: int) -> str:
        return os.path.join(self.out, "adapters", f"step-{step}")

    def export(self, ckpt: Checkpoint) -> str | None:
        """The checkpoint as a ``--target vllm`` adapter (None, with one line, when the run's retention
        removed it first)."""
        from ckptbridge import convert_orbax_to_peft
        from ckptbridge.errors import CkptBridgeError

        dst = self.adapter_dir(ckpt.step)
        if all(os.path.isfile(os.path.join(dst, f)) for f in ADAPTER_FILES):
            return dst  # exported already (the export writes its directory whole or not at all)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            convert_orbax_to_peft(ckpt.path, dst, base=self.base, target="vllm", overwrite=True, progress=False)
        except (CkptBridgeError, OSError):
            time.sleep(1.0)  # a retention delete is not atomic: look again once it is through
            storage.forget(ckpt.path)
            if _commit_time(ckpt.path) is None or not storage.isdir(storage.join(ckpt.path, ITEM)):
                self.say(f"watch: step {ckpt.step}: removed by the run's retention before it was exported; skipped")
                return None
            raise
        return dst

    def lint(self, adapter: str) -> tuple[int, bool]:
        """Lint the adapter for vLLM: the --max-lora-rank it needs, and whether it changes the model
        (a checkpoint saved before the learning rate left zero, in warmup, does not: it is scored as
        the base it equals, with a line saying so)."""
        from ckptbridge.adapter_check import lint_adapter
        from ckptbridge.errors import MismatchError

        lint = lint_adapter(adapter, self.base, target="vllm")
        errors = [f for f in lint.errors if f.check != LIVE]
        if errors:
            raise MismatchError(f"{adapter}: {errors[0].message}")
        return lint.max_lora_rank, len(errors) == len(lint.errors)

    def score(self, server: LoraServer, ckpt: Checkpoint, adapter: str, live: bool = True) -> dict:
        """Load, probe, generate and score one checkpoint; its row."""
        from ckptbridge.verify import served_parity
        from serving.evaluate import generate, score

        name = f"step-{ckpt.step}"
        if name not in server.models():
            server.load(name, adapter)
        verdict = "not checked"
        if self.parity_tokens:
            parity = served_parity(server.url, name, self.base, adapter=adapter, tokens=self.parity_tokens)
            verdict = "equal" if parity.equal else f"differs at token {parity.first_divergence}"
        samples = os.path.join(self.out, "samples", f"{name}.jsonl")
        os.makedirs(os.path.dirname(samples), exist_ok=True)
        whole_lines(samples)  # samples of a watch killed mid-line: resumed from the last whole one
        generate(server.url, name, self.problems, samples, n=self.samples, temperature=self.temperature,
                 max_tokens=self.max_tokens, seed=ckpt.step, progress=False)
        result_path = os.path.join(self.out, "scores", f"{name}.json")
        os.makedirs(os.path.dirname(result_path), exist_ok=True)
        result = score(self.problems, samples, result_path, ks=self.ks, progress=False)
        row = {"step": ckpt.step, "loss": loss_at(storage.join(self.run_dir, "metrics.jsonl"), ckpt.step),
               "adapter": adapter, "changes_model": live, "served_parity": verdict,
               "seconds_commit_to_score": round(time.time() - ckpt.committed, 1)}
        for k in self.ks:
            row[f"pass@{k}"] = result.get(f"pass@{k}")
        return row

    def retire(self, server: LoraServer, rows: list[dict]) -> None:
        """Unload scored adapters beyond the ``keep`` newest; the best one stays."""
        top = best(rows)
        keep = {r["step"] for r in sorted(rows, key=lambda r: r["step"])[-self.keep:]}
        if top is not None:
            keep.add(top["step"])
        loaded = set(server.models())
        for r in rows:
            name = f"step-{r['step']}"
            if r["step"] not in keep and name in loaded:
                server.unload(name)

    def line(self, row: dict) -> str:
        passes = ", ".join(f"pass@{k} {row[f'pass@{k}']:.3f}" if row.get(f"pass@{k}") is not None else f"pass@{k} -"
                           for k in self.ks)
        loss = f"loss {row['loss']:.4f}" if row.get("loss") is not None else "loss -"
        return (f"watch: step {row['step']}: {loss}, {passes}, served parity {row['served_parity']}, "
                f"{row['seconds_commit_to_score']:.0f} s from commit to score")

    def pass_once(self, server: LoraServer, rows: Rows) -> int:
        """Score every committed checkpoint without a row; how many were scored."""
        n = 0
        for ckpt in pending(self.root, rows.steps):
            adapter = self.export(ckpt)
            if adapter is None:
                continue
            _, live = self.lint(adapter)
            if not live:
                self.say(f"watch: step {ckpt.step}: the adapter changes nothing yet (every module's lora_B or lora_A "
                         "is zero: a checkpoint saved before the learning rate left zero); scored as the base")
            row = self.score(server, ckpt, adapter, live)
            rows.append(row)
            self.say(self.line(row))
            write_best(self.out, rows.rows)
            plot(self.out, rows.rows, self.ks)
            self.retire(server, rows.rows)
            n += 1
        return n


def run_finished(run_dir: str) -> bool:
    """The training run wrote its summary (``run.json``): no more checkpoints will come."""
    return storage.isfile(storage.join(run_dir, "run.json"))


SERVER = "server.json"  # the server this watch started: {"pid", "url", "base"}; gone once it is stopped


class OwnServer:
    """The local vLLM a watch started (or adopted from a watch killed before it could stop it),
    recorded in ``OUT/server.json`` from its start: stopped, with its process group, when the watch
    ends."""

    def __init__(self, out: str, pid: int, url: str, local=None):
        self.out, self.pid, self.url, self.local = out, pid, url, local

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
        else:
            _kill_group(self.pid)
        try:
            os.remove(os.path.join(self.out, SERVER))
        except FileNotFoundError:
            pass


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(300):
            os.killpg(pid, 0)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _record(out: str) -> dict | None:
    try:
        with open(os.path.join(out, SERVER)) as f:
            record = json.load(f)
        os.killpg(int(record["pid"]), 0)
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adopt_server(out: str, base: str, say: Callable[[str], None], timeout: float = 600.0) -> OwnServer | None:
    """The server a killed watch with the same OUT left running (waiting for it while it starts),
    when it serves ``base``; one that serves another base or does not answer is stopped."""
    record = _record(out)
    if record is None:
        return None
    own = OwnServer(out, int(record["pid"]), record["url"])
    if record.get("base") == os.path.abspath(base):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _record(out) is not None:
            try:
                LoraServer(record["url"]).models()
                return own
            except ServerGone:
                time.sleep(1.0)  # still starting
    say(f"watch: stopping the server a killed watch left at {record['url']} (another base, or not answering)")
    own.stop()
    return None


def lora_server_command(profile, base: str, *, rank: int, max_loras: int, port: int | None = None,
                        dtype: str | None = None, max_model_len: int | None = None):
    """The command of a vLLM on ``base`` that takes LoRA adapters of rank <= ``rank`` at run time."""
    from serving.profiles import RUNTIME_LORA_ENV, build_command
    from serving.server import free_port

    cmd = build_command(profile, base, port=port or free_port(), max_model_len=max_model_len, dtype=dtype,
                        extra_args=["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(max_loras)])
    cmd.env[RUNTIME_LORA_ENV] = "True"
    return cmd


def start_server(w: Watch, profile, rank: int, *, port: int | None, dtype: str, max_model_len: int) -> OwnServer:
    """A local vLLM on the base that takes adapters at run time; recorded in OUT/server.json."""
    from serving.server import LocalServer

    cmd = lora_server_command(profile, w.base, rank=rank, max_loras=w.keep + 2, port=port, dtype=dtype,
                              max_model_len=max_model_len)
    local = LocalServer(cmd, os.path.join(w.out, "server.log"), outlive=True)
    local.start()
    own = OwnServer(w.out, local.proc.pid, local.url, local)
    # recorded before it is up: a watch killed meanwhile is followed by one that waits
    _replace(os.path.join(w.out, SERVER),
             json.dumps({"pid": local.proc.pid, "url": local.url, "base": os.path.abspath(w.base)}))
    try:
        local.wait_ready()
    except BaseException:
        own.stop()
        raise
    return own


class Busy:
    """``OUT/watch.lock``, held while a watch writes to OUT: a second watch on the same OUT (an
    overlapping cron ``--once``) is refused in one line instead of scoring steps twice."""

    def __init__(self, out: str):
        import fcntl

        self.f = open(os.path.join(out, LOCK), "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.f.seek(0)
            pid = self.f.read().strip() or "?"
            self.f.close()
            from ckptbridge.errors import ConfigError

            raise ConfigError(f"{out}: another watch (pid {pid}) is writing here; wait for it or use another --out") \
                from None
        self.f.seek(0)
        self.f.truncate()
        self.f.write(str(os.getpid()))
        self.f.flush()

    def release(self) -> None:
        self.f.close()


def _alive(server: LoraServer) -> bool:
    try:
        server.models()
        return True
    except ServerGone:
        return False


def watch(w: Watch, *, server_url: str | None, profile=None, once: bool = False, poll: float = 10.0,
          port: int | None = None, dtype: str = "auto", max_model_len: int = 4096,
          finished: Callable[[], bool] | None = None) -> int:
    """Follow the run until it finished and every checkpoint has a row (``once``: score what is there
    and return). ``finished``: whether the run wrote its last checkpoint (default: its ``run.json``
    is there; a caller that started the training process can say when it exited). Returns how many
    checkpoints were scored by this call."""
    finished = finished or (lambda: run_finished(w.run_dir))
    os.makedirs(w.out, exist_ok=True)
    busy = Busy(w.out)
    own = None
    try:
        rows = Rows(w.out)
        if rows.rows:
            w.say(f"watch: {len(rows.rows)} step(s) scored already ({', '.join(str(s) for s in sorted(rows.steps))}); "
                  "not scored again")
            write_best(w.out, rows.rows)  # as of the last row (a kill can come between a row and these)
            plot(w.out, rows.rows, w.ks)
        if server_url:
            left = _record(w.out)
            if left is not None:
                w.say(f"watch: stopping the server a killed watch left at {left['url']} (--server is used now)")
                OwnServer(w.out, int(left["pid"]), left["url"]).stop()
        else:
            own = adopt_server(w.out, w.base, w.say)
            if own is not None:
                w.say(f"watch: using the server the last watch left running at {own.url}")
        server = LoraServer(server_url) if server_url else LoraServer(own.url) if own is not None else None
        scored = 0
        while True:
            done = finished()  # read before listing: a last checkpoint is then listed too
            try:
                todo = pending(w.root, rows.steps)
            except OSError as e:  # Cloud Storage answering with an error now and then: look again next time
                w.say(f"watch: could not list {w.root} ({type(e).__name__}: {e}); trying again in {poll:g} s")
                todo, done = [], False
            if todo and server is None:
                for ckpt in todo:  # the first that can be exported sets the server's --max-lora-rank
                    first = w.export(ckpt)
                    if first is not None:
                        own = start_server(w, profile, w.lint(first)[0], port=port, dtype=dtype,
                                           max_model_len=max_model_len)
                        server = LoraServer(own.url)
                        w.say(f"watch: vLLM serving {w.base} at {own.url} (log: {os.path.join(w.out, 'server.log')})")
                        break
            if todo and server is not None:
                try:
                    scored += w.pass_once(server, rows)
                except Exception as e:
                    from ckptbridge.errors import CkptBridgeError

                    if isinstance(e, ServerGone) or (isinstance(e, CkptBridgeError) or _transport(e)) \
                            and not _alive(server):
                        raise ServerGone(f"the server at {server.url} went away; the {len(rows.rows)} row(s) so far "
                                         f"are in {rows.path}") from None
                    raise
            if once or (done and not pending(w.root, rows.steps)):
                return scored
            time.sleep(poll)
    finally:
        if own is not None:
            own.stop()
        busy.release()


def _transport(e: Exception) -> bool:
    import httpx

    return isinstance(e, httpx.TransportError)
