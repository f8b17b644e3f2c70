"""Screenshots of TensorBoard over a short demo run, as a user sees it, for the README (docs/*.png).

    python benchmarks/tensorboard_screenshots.py [--steps 60] [--out docs] [--run-dir runs/tensorboard-demo/demo]

What it needs (none of it is a seg-train dependency; not part of `make test`):
    apt-get install -y chromium                        # Debian's Chromium, driven headless
    .venv/bin/pip install playwright                   # Python driver; uses /usr/bin/chromium, downloads no browser
    .venv/bin/pip install -e '.[tensorboard]'          # TensorBoard and its Profile tab (tensorboard-plugin-profile)

Steps:
1. trains the demo config on 4 towers for --steps steps (unless the run dir already holds that run):
   summaries every 2 steps, pictures every 20, an evaluation every 30, a profile of steps 5..7;
2. starts TensorBoard on 127.0.0.1 (a free port) over the run dir's parent;
3. checks TensorBoard's HTTP API like a user would: the tower runs, the scalar, image and text tags,
   that an image of each new tag decodes as PNG, and that the Profile tab lists the profile;
4. takes headless-Chromium screenshots of the Time Series, Images and Profile views into --out:
   tensorboard_time_series.png, tensorboard_images.png, tensorboard_profile.png;
5. stops TensorBoard.

The Profile tab's overview charts load Google Charts from the internet; the trace viewer does not,
so the profile screenshot is the trace viewer (works offline).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOWERS = 4
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def train(run_dir: Path, steps: int) -> None:
    if (run_dir / "checkpoints" / f"ckpt-{steps}.index").is_file():
        print(f"using the existing run {run_dir}")
        return
    # The seg-train command itself: its main thread, named after it, is the one the profile view shows.
    cmd = [str(Path(sys.executable).with_name("seg-train")), "--config", str(ROOT / "configs" / "demo.yaml"),
           "--gpus", str(TOWERS), "--run-dir", str(run_dir),
           "--set", f"train.num_steps={steps}", "--set", "train.summary_every=2",
           "--set", "train.image_summary_every=20", "--set", f"train.eval_every={max(1, steps // 2)}",
           "--set", f"train.checkpoint_every={max(1, steps // 2)}", "--set", "train.profile_steps=[5, 7]"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(base: str, path: str, **params):
    url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
        if r.headers.get("Content-Encoding") == "gzip":  # the profile plugin compresses unasked
            body = gzip.decompress(body)
    return body if r.headers.get_content_type().startswith("image/") else json.loads(body)


def wait_for_runs(base: str, expected: set[str], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if expected <= set(get(base, "/data/runs")):
                return
        except OSError:
            pass
        if time.time() > deadline:
            raise SystemExit(f"TensorBoard at {base} did not list the runs {sorted(expected)}")
        time.sleep(1)


def check_api(base: str, name: str) -> dict:
    """Asserts through TensorBoard's HTTP API what a user should find; returns the profile's session and host."""
    from PIL import Image

    towers = [f"{name}/towers/tower_{i}" for i in range(TOWERS)]
    runs = get(base, "/data/runs")
    assert name in runs and set(towers) <= set(runs), runs
    print(f"ok  runs: {runs}")
    scalars = get(base, "/data/plugin/scalars/tags")
    for run in towers:
        assert list(scalars[run]) == ["loss/tower"], (run, scalars[run])
    main = set(scalars[name])
    for tag in ["loss/total", "learning_rate", "eval/miou", *[f"loss/tower_{i}" for i in range(TOWERS)]]:
        assert tag in main, (tag, sorted(main))
    print(f"ok  scalars: loss/tower in each of {len(towers)} tower runs; {len(main)} tags in {name!r}")
    images = get(base, "/data/plugin/images/tags")[name]
    new = ["eval/confusion_matrix", "eval/examples", *[f"tower_{i}/triplet" for i in range(TOWERS)]]
    old = [f"tower_{i}/{k}" for i in range(TOWERS) for k in ("image", "label", "prediction")]
    for tag in new + old:
        assert tag in images, (tag, sorted(images))
    for tag in new:
        entries = get(base, "/data/plugin/images/images", run=name, tag=tag, sample=0)
        blob = get(base, "/data/plugin/images/individualImage?" + entries[-1]["query"])
        assert blob[:8] == b"\x89PNG\r\n\x1a\n", tag
        size = Image.open(io.BytesIO(blob)).size
        print(f"ok  image {tag} at step {entries[-1]['step']}: PNG {size[0]}x{size[1]} "
              f"({images[tag]['samples']} sample(s), {len(entries)} step(s))")
    text = get(base, "/data/plugin/text/tags")
    assert "config" in text.get(name, []), text
    segments = get(base, "/data/plugin/text/text", run=name, tag="config")
    html = segments[0]["text"]
    assert "<pre><code>" in html and "num_steps:" in html and "profile_steps: [5, 7]" in html, html[:500]
    print(f"ok  text: config at step(s) {[e['step'] for e in segments]}, rendered as a code block")
    sessions = get(base, "/data/plugin/profile/runs")
    assert sessions, "the Profile tab lists no profile"
    session = sessions[-1]
    tools = get(base, "/data/plugin/profile/run_tools", run=session)
    hosts = get(base, "/data/plugin/profile/hosts", run=session, tag="trace_viewer@")
    assert "trace_viewer@" in tools and hosts, (tools, hosts)
    print(f"ok  profile: session {session}, tools {tools}, host {hosts[0]['hostname']}")
    return {"session": session, "host": hosts[0]["hostname"]}


def screenshots(base: str, out: Path, name: str, profile: dict) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
                                    args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})

        # Time Series: the tower curves pinned at the top, no smoothing (the towers' spread is the point).
        pins = [{"plugin": "scalars", "tag": t} for t in ("loss/tower", "eval/miou")]
        query = urllib.parse.urlencode({"smoothing": "0", "pinnedCards": json.dumps(pins)})
        page.goto(f"{base}/?{query}#timeseries")
        page.get_by_text("Pinned").first.wait_for()
        page.get_by_role("button", name="Toggle settings side pane").click()  # open by default; hides cards
        # The tower chart across the page: room for its four lines and its table of the four towers.
        page.get_by_role("button", name="Toggle full size mode").first.click()
        page.wait_for_timeout(4000)
        page.screenshot(path=str(out / "tensorboard_time_series.png"))

        # Images: the evaluation pictures and one tower's triplets (scaled to the card width, as by default).
        page.set_viewport_size({"width": 1400, "height": 1500})
        page.goto(f"{base}/#images&tagFilter=" + urllib.parse.quote("tower_0/triplet|eval/"))
        page.get_by_text("tower_0/triplet").first.wait_for()
        page.wait_for_timeout(4000)
        page.screenshot(path=str(out / "tensorboard_images.png"))
        page.set_viewport_size({"width": 1400, "height": 900})

        # Profile: the trace viewer, scrolled to the training thread (steps "train N" and their ops).
        query = urllib.parse.urlencode({"run": profile["session"], "tag": "trace_viewer@", "host": profile["host"]})
        page.goto(f"{base}/?{query}#profile")
        deadline = time.time() + 120
        while not any("trace_viewer_index" in f.url for f in page.frames):
            if time.time() > deadline:
                raise SystemExit("the Profile tab's trace viewer did not load")
            page.wait_for_timeout(500)
        viewer = next(f for f in page.frames if "trace_viewer_index" in f.url)
        viewer.get_by_text("/host:CPU").first.wait_for(state="attached", timeout=120_000)  # the trace is in
        viewer.get_by_text("Expand All", exact=True).click()
        thread = viewer.get_by_text("seg-train", exact=True).first
        thread.wait_for(state="attached")
        page.wait_for_timeout(2000)  # the expanded tracks are laid out before scrolling to one
        thread.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(2000)
        page.screenshot(path=str(out / "tensorboard_profile.png"))
        browser.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "tensorboard-demo" / "demo")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    args = p.parse_args()
    try:
        import playwright  # noqa: F401
        import tensorboard_plugin_profile  # noqa: F401
    except ImportError as e:
        print(f"error: {e.name} is not installed: see the top of {Path(__file__).name}", file=sys.stderr)
        return 2
    run_dir = args.run_dir.resolve()
    train(run_dir, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tensorboard = Path(sys.executable).with_name("tensorboard")
    server = subprocess.Popen([str(tensorboard), "--logdir", str(run_dir.parent), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        name = run_dir.name
        wait_for_runs(base, {name, *(f"{name}/towers/tower_{i}" for i in range(TOWERS))})
        profile = check_api(base, name)
        screenshots(base, args.out, name, profile)
    finally:
        server.terminate()
        server.wait(timeout=30)
    for f in ("tensorboard_time_series.png", "tensorboard_images.png", "tensorboard_profile.png"):
        print(f"wrote {args.out / f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
