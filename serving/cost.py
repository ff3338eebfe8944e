"""Cost model: $/1M output tokens from an hourly rate and a throughput, and total cost of
ownership (training once, then serving H hours)."""

from __future__ import annotations

# Google Cloud on-demand rates used in the paper ($/hour)
RATES = {"tpu-v5p-8": 16.80, "tpu-v6e-8": 21.52, "gpu-h100x2": 22.12}
TCO_HOURS = (1.0, 8.0, 24.0)


def cost_per_million(usd_per_hour: float, tokens_per_s: float) -> float | None:
    """$ per 1M tokens = rate / (tokens/s x 3600 / 1e6)."""
    if not tokens_per_s:
        return None
    return usd_per_hour / (tokens_per_s * 3600 / 1e6)


def training_cost(usd_per_hour: float, hours: float) -> float:
    return usd_per_hour * hours


def tco_table(train_cost: float, serve_usd_per_hour: float, hours=TCO_HOURS) -> list[dict]:
    """TCO(H) = training cost + H x serving rate."""
    return [{"hours": h, "training_usd": train_cost, "serving_usd": h * serve_usd_per_hour,
             "total_usd": train_cost + h * serve_usd_per_hour} for h in hours]


def format_tco(rows: list[dict]) -> str:
    lines = [f"{'serving hours':>13} {'training $':>11} {'serving $':>10} {'total $':>9}"]
    lines += [f"{r['hours']:>13g} {r['training_usd']:>11.2f} {r['serving_usd']:>10.2f} {r['total_usd']:>9.2f}"
              for r in rows]
    return "\n".join(lines)
