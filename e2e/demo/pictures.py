"""Part 7: pictures from the TrainingJob's MLflow run: the loss curve with the restart marked (matplotlib, from the
run's metric history) and the run page as a browser shows it (headless Chromium, when installed).

They go to the demo's own output folder (OUTPUT, under the git-ignored .state/), never over tracked files: a new
user's checkout stays clean after `make demo`. Refreshing the README's pictures in docs/img/ from the last run is a
separate, deliberate step: `make readme-pictures` (`python -m loom.e2e.demo.pictures --refresh-readme`)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .mlflow_run import Resume, kill_mark, loss_history, resumes, run_tags
from .stage import WORKDIR, Demo, Outcome

# Where the demo writes (git-ignored) and where the README shows them (tracked; only `refresh_readme` writes there).
OUTPUT = WORKDIR / "pictures"
README_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"
LOSS_NAME, RUN_NAME = "demo-loss-curve.png", "demo-mlflow-run.png"
LOSS_PNG, RUN_PNG = OUTPUT / LOSS_NAME, OUTPUT / RUN_NAME
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
    kill_step = kill_mark(kill_step, resumed)  # the two marks never contradict: a kill before its resume point
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
    return Outcome(f"pictures in {OUTPUT}: {', '.join(made)}", f"{len(points)} loss points")


def refresh_readme(source: Path = OUTPUT, target: Path = README_IMAGES) -> list[Path]:
    """Copy the last demo's pictures over the README's (the deliberate step); a clear error when there are none."""
    found = [source / name for name in (LOSS_NAME, RUN_NAME) if (source / name).is_file()]
    if not found:
        raise FileNotFoundError(f"no demo pictures in {source}: run `make demo` first")
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for picture in found:
        shutil.copyfile(picture, target / picture.name)
        copied.append(target / picture.name)
    return copied


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loom.e2e.demo.pictures")
    parser.add_argument("--refresh-readme", action="store_true", help=f"copy {OUTPUT}/*.png to {README_IMAGES}")
    args = parser.parse_args(argv)
    if not args.refresh_readme:
        parser.error(f"nothing to do: the demo writes its pictures to {OUTPUT}; --refresh-readme copies them")
    try:
        copied = refresh_readme()
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None
    for path in copied:
        print(f"{path} <- {OUTPUT / path.name}")


if __name__ == "__main__":
    main()
