"""Part 7: pictures from the TrainingJob's MLflow run: the loss curve with the restart marked (matplotlib, from the
run's metric history) and the run page as a browser shows it (headless Chromium, when installed)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .mlflow_run import Resume, loss_history, resumes, run_tags
from .stage import Demo, Outcome

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"
LOSS_PNG, RUN_PNG = IMAGES / "demo-loss-curve.png", IMAGES / "demo-mlflow-run.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
HOW_TO_GET_CHROMIUM = "apt-get install -y chromium (Debian/Ubuntu), then run the demo again"


def plot_loss(points: list[dict[str, Any]], kill_step: int, resumed: list[Resume], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    # Steps logged again after the restart (from the checkpoint on) are drawn as the second attempt.
    first: list[tuple[int, float]] = []
    second: list[tuple[int, float]] = []
    seen_max = -1
    for point in points:
        (second if second or point["step"] <= seen_max else first).append((point["step"], point["value"]))
        seen_max = max(seen_max, point["step"])
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    if first:
        ax.plot(*zip(*first, strict=True), color="#1f77b4", label="training loss")
    if second:
        ax.plot(*zip(*second, strict=True), color="#2ca02c", label="after the restart")
    if kill_step:
        ax.axvline(kill_step, color="#d62728", linestyle="--", linewidth=1)
        ax.annotate(
            f"worker killed (step {kill_step})",
            xy=(kill_step, ax.get_ylim()[1]),
            xytext=(4, -14),
            textcoords="offset points",
            color="#d62728",
            fontsize=9,
        )
    for number, resume in enumerate(resumed):
        # Where the run's loom.resume.* tag says training went on from.
        ax.axvline(resume.step, color="#ff7f0e", linestyle=":", linewidth=1)
        ax.annotate(
            f"resumed from checkpoint (step {resume.step})",
            xy=(resume.step, ax.get_ylim()[1]),
            xytext=(4, -28 - 14 * number),
            textcoords="offset points",
            color="#ff7f0e",
            fontsize=9,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def screenshot(binary: str, url: str, out: Path) -> None:
    """The page after its scripts ran (MLflow's UI is a single-page app): virtual time lets them finish."""
    with tempfile.TemporaryDirectory(prefix="loom-demo-chromium-") as profile:
        subprocess.run(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--window-size=1440,1000",
                "--virtual-time-budget=25000",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )


def run(demo: Demo) -> Outcome:
    assert demo.services is not None
    run_id, run_url = demo.facts.get("run_id"), demo.facts.get("run_url") or ""
    if not run_id:
        raise RuntimeError("the TrainingJob's status names no MLflow run")
    host_url = run_url.replace(run_url.split("/#")[0], demo.services.mlflow_url) if "/#" in run_url else run_url
    demo.facts["run_url_host"] = host_url
    points = loss_history(demo.services.mlflow_url, run_id)
    resumed = resumes(run_tags(demo.services.mlflow_url, run_id))
    title = f"TrainingJob {demo.facts.get('training')}: loss (MLflow run {run_id[:8]})"
    plot_loss(points, demo.facts.get("kill_step", 0), resumed, title, LOSS_PNG)
    tagged = ", ".join(f"resumed from {r.uri}" for r in resumed) or "no resume tags"
    demo.ui.info(f"loss curve ({len(points)} points from MLflow; {tagged}) -> {LOSS_PNG}")
    made = [LOSS_PNG.name]
    binary = browser()
    if binary is None:
        demo.ui.info(f"no Chromium for the run page's screenshot: {HOW_TO_GET_CHROMIUM}")
    else:
        screenshot(binary, host_url, RUN_PNG)
        demo.ui.info(f"MLflow run page in headless {Path(binary).name} -> {RUN_PNG}")
        made.append(RUN_PNG.name)
    return Outcome(f"pictures in docs/img/: {', '.join(made)}", f"{len(points)} loss points")
