"""The docs site builds strict and renders in a real browser (issue 44: `mkdocs build --strict`
in CI, and a test that opens the built site in headless Chromium).

The site is built here with ``mkdocs build --strict`` (or taken from ``$ROLLART_SITE_DIR``,
which ``make docs-check`` points at the ``site/`` that ``make docs`` just built strict), served
by ``http.server`` on a free localhost port, and opened by Chromium: ``--dump-dom`` gives the
DOM after the page's scripts ran, ``--screenshot`` a picture (kept in ``$ROLLART_SITE_SHOTS``
when set). Skipped, saying why, where mkdocs (``make setup-docs``: ``.venv-docs``) or a
Chromium is missing; ``make docs-check`` installs both.
"""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed: `make docs-check` runs this "
                                     "test in .venv-docs (the docs extra)")
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))),
                None)
if CHROMIUM is None:
    pytest.skip("no chromium on PATH: `make docs-check` installs it with apt-get as root "
                "(apt-get install chromium)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=5000"]
RAN_SCRIPTS = ("md-typeset__scrollwrap", "md-code__button")
"""Classes Material's JavaScript adds (a table's scroll wrapper, a code block's copy button):
present only when the browser ran the page's scripts, never in the built HTML."""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    given = os.environ.get("ROLLART_SITE_DIR")
    if given:
        return Path(given).resolve()
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def url(site):
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the browser's requests are not the test's output
        pass


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    d = Path(os.environ.get("ROLLART_SITE_SHOTS") or tmp_path_factory.mktemp("shots"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def chromium(tmp_path: Path, *args: str) -> str:
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def rendered(tmp_path: Path, page_url: str, shot: Path) -> str:
    """The DOM of ``page_url`` after its scripts ran; its screenshot written to ``shot``."""
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,900", page_url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000, shot
    dom = chromium(tmp_path, "--dump-dom", page_url)
    assert any(c in dom for c in RAN_SCRIPTS), "the page's scripts did not run"
    return dom


def title(dom: str) -> str:
    m = re.search(r"<title>(.*?)</title>", dom, re.S)
    return html.unescape(m[1]).strip() if m else ""


def nav_labels(dom: str) -> list[str]:
    """The labels of Material's primary navigation."""
    start = dom.index('class="md-nav md-nav--primary"')
    return [html.unescape(re.sub(r"<[^>]+>", "", s)).strip()
            for s in re.findall(r'<span class="md-ellipsis">(.*?)</span>', dom[start:], re.S)]


def test_home_page_renders(url, shots, tmp_path):
    dom = rendered(tmp_path, url + "/", shots / "home.png")
    assert title(dom) == "rollart"
    assert re.search(r'<h1 id="rollart">rollart', dom)
    labels = nav_labels(dom)
    for label in ("Quick start", "Your env", "Your agent", "Many hosts", "Config keys", "Design"):
        assert label in labels, labels
    assert '<img alt="Trajectory Gantt' in dom and 'src="img/gantt.png"' in dom


def test_a_tutorial_renders(url, shots, tmp_path):
    dom = rendered(tmp_path, url + "/quickstart/", shots / "quickstart.png")
    assert title(dom) == "Quick start - rollart"
    assert re.search(r'<h1 id="quick-start">Quick start', dom)
    assert re.search(r'<h2 id="the-quickstart-learns-every-time">', dom)
    assert 'md-nav__link--active' in dom  # the navigation marks the page being read
    assert "rollart run --resume runs/&lt;run&gt;" in dom


def test_config_reference_lists_every_key(site):
    from rollart.config.doc import iter_keys
    from rollart.config.schema import RunConfig

    text = html.unescape((site / "config-reference" / "index.html").read_text())
    missing = [k.path for k in iter_keys(RunConfig) if f"<code>{k.path}</code>" not in text]
    assert not missing, missing
    assert "<code>args.max_steps</code>" in text  # the built-in env types' arguments


def test_api_reference_renders_the_embedding_api(site):
    def page(name: str) -> str:
        return (site / "reference" / name / "index.html").read_text()

    assert 'id="rollart.node.Node"' in page("node")
    for cls in ("scheduler.actor.RolloutScheduler", "env.manager.EnvManager",
                "generate.proxy.LLMProxy", "trainer.actor.Trainer", "reward.actor.RewardService"):
        assert f'id="rollart.actors.{cls}"' in page("actors"), cls
    assert 'id="rollart.envs.base.Env"' in page("envs")
    assert 'id="rollart.messages.types.RolloutCompleted"' in page("messages")
    assert ":class:" not in page("envs")  # Sphinx role names are dropped, their code kept
