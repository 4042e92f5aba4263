"""`nexrl report RUN_DIR`: one self-contained HTML page of a real (mock-model) run, read as HTML
here and loaded in a real headless browser (Debian's chromium) behind a loopback proxy that
records every request the page makes: its plots render, its filter works, it fetches nothing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import urllib.parse
import zlib
from pathlib import Path

import pytest

from nexrl_core.cli.report import _PALETTE, svg_chart
from nexrl_core.cli.show import _prompt_text
from tests.core.test_run_ux import clean_env, nexrl, rows
from tests.support.html_page import Page

SECRET = "sk-report-secret-4711"
#: what a prompt may hold: markup that would fetch (were it not escaped), quotes, entities, model junk
JUNK = ('<img src="http://127.0.0.1:{port}/img"> & "double" \'single\' </td></table>'
        '<script>fetch("http://127.0.0.1:{port}/js")</script> &amp; \x1b[31m<|im_end|>')

# Every step trains on all five prompts (batch 10 = 5 prompts x 2) and samples all ten
# trajectories, so each filter below has rows to leave out: "1 + 2 …" is answered wrongly at
# step 1 only (the mock model learns it at weight version 1), "2 + 2 …" always rightly, the bare
# junk (echoed) never, "hello" (echoed) always.
RECIPE = """\
experiment_name: report-demo
run_dir: {run_dir}
data:
  type: inline
  rows:
    - {{prompt: {sum_wrong_first}, answer: "3"}}
    - {{prompt: {sum_right}, answer: "4"}}
    - {{prompt: {junk}, answer: "x"}}
    - {{prompt: "key {secret} here", answer: "y"}}
    - {{prompt: "hello", answer: "hello"}}
validate:
  data:
    type: inline
    rows:
      - {{prompt: "1 + 1", answer: "2"}}
      - {{prompt: "3 + 1", answer: "4"}}
rollout_worker: {{num_workers: 2, sampling: {{max_tokens: 512}}}}
trajectory_pool: {{batch_size: 10, group_size: 2}}
trainer: {{type: mock, total_train_steps: 4}}
weight: {{validate_freq: 2}}
logger: {{samples_every: 2, samples_per_step: 10}}
service:
  inference_service: {{backend: mock, mode: sum}}
"""


class RecordingProxy:
    """A loopback TCP server that records the first line of every request made to it (as an HTTP
    proxy or directly) and answers 404."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    data = conn.recv(4096)
                    self.requests.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    self.requests.append("(a connection without a request)")

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def proxy():
    server = RecordingProxy()
    yield server
    server.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, proxy) -> Path:
    """A 4-step run of the mock model (steps 1, 2 and 4 sampled), its data holding junk and a secret."""
    root = tmp_path_factory.mktemp("report")
    run_dir = root / "run"
    junk = JUNK.format(port=proxy.port)
    (root / "recipe.yaml").write_text(RECIPE.format(run_dir=run_dir, secret=SECRET, junk=json.dumps(junk),
                                                    sum_wrong_first=json.dumps(f"1 + 2 {junk}"),
                                                    sum_right=json.dumps(f"2 + 2 {junk}")))
    run = nexrl(root, "run", root / "recipe.yaml", env=_env(root))
    assert run.returncode == 0, run.stderr
    return run_dir


def _env(root: Path) -> dict[str, str]:
    return clean_env(root, NEXRL_TEST_API_KEY=SECRET)  # named like a secret: every output hides its value


@pytest.fixture(scope="module")
def page(run_dir) -> Path:
    """``nexrl report RUN_DIR``, run as a user would (a real process, the secret in its environment)."""
    done = nexrl(run_dir.parent, "report", run_dir, env=_env(run_dir.parent))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == f"{run_dir / 'report.html'}\n"
    return run_dir / "report.html"


def _report(capsys, *args) -> tuple[int, str, str]:
    from nexrl_core.cli import main

    code = main(["report", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- the page as HTML


def test_the_page_holds_the_plots_and_every_sample_escaped(run_dir, page, proxy):
    text = page.read_text(encoding="utf-8")
    page = Page(text)
    samples = rows(run_dir / "samples.jsonl")
    metrics = rows(run_dir / "metrics.jsonl")
    assert [s["step"] for s in samples] == [1] * 10 + [2] * 10 + [4] * 10
    # plots: training reward (raw and running mean), validation, loss; and one small plot per metric
    assert page.count("svg", **{"class": "chart"}) >= 3
    numeric = {k for r in metrics for k, v in r.items()
               if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert f"every metric ({len(numeric)})" in text
    assert page.count("svg", **{"class": "chart"}) == 3 + len(numeric)
    reward_points = [t for t, a in page.tags if t == "polyline" and a.get("stroke") == _PALETTE[0]]
    assert len(reward_points) >= 2
    train_steps = sorted({r["step"] for r in metrics if "train/reward_mean" in r})
    assert train_steps == [1, 2, 3, 4]
    first = next(a for t, a in page.tags if t == "polyline")  # the raw training reward: a point per step
    assert len(first["points"].split()) == len(train_steps)
    # the table: a row per sample, in file order, every text exactly as recorded
    assert len(page.rows) == len(samples)
    for (attrs, cells), sample in zip(page.rows, samples):
        assert attrs["data-step"] == str(sample["step"]) and float(attrs["data-reward"]) == sample["reward"]
        assert cells[0] == str(sample["step"])
        assert cells[1].startswith(f"{sample['uid']}#{sample['sample_index']}")
        assert cells[3] == "-"  # the mock trainer computes no advantage
        assert cells[4] == _prompt_text(sample["prompt"]) and cells[5] == sample["response"]
    junk = JUNK.format(port=proxy.port)
    assert sum(junk in cells[4] for _, cells in page.rows) == 18 and sum(junk in c[5] for _, c in page.rows) == 6
    # escaped: no markup of the data's reached the page as markup
    assert page.count("img") == 0 and page.count("script") == 1 and page.count("table") == 1
    # the secret in the data shows as *** (the run wrote it so; the page keeps it so)
    assert SECRET not in text and any("key *** here" in cells[4] for _, cells in page.rows)


def test_the_page_refers_to_nothing_outside_itself(page):
    text = page.read_text(encoding="utf-8")
    page = Page(text)
    for tag, attrs in page.tags:
        for name in ("src", "href", "action", "data", "poster", "srcset", "xmlns", "background"):
            assert name not in attrs, (tag, attrs)
    assert page.count("link") == 0 and "@import" not in text and "url(" not in text
    policy = next(a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert policy.startswith("default-src 'none';")
    # every URL in the page is escaped data of the run, inside the sample table
    outside = text.split('<table id="samples">')[0] + text.split("</table>")[-1]
    assert "http:" not in outside and "https:" not in outside and "//" not in outside.replace("://", "")


def test_a_secret_in_an_older_record_is_scrubbed_and_out_writes_elsewhere(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEXRL_TEST_API_KEY", SECRET)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report.html"))
    with open(copy / "samples.jsonl", "a", encoding="utf-8") as f:  # as a run that did not know the key wrote it
        f.write(json.dumps({"step": 9, "uid": "u", "prompt": f"raw {SECRET}", "response": "r", "reward": 0.5}) + "\n")
    out = tmp_path / "pages" / "r.html"
    assert _report(capsys, copy, "-o", out) == (0, f"{out}\n", "")
    assert not (copy / "report.html").exists()
    text = out.read_text(encoding="utf-8")
    assert SECRET not in text and "raw ***" in text


def test_a_large_step_logprob_gap_is_marked_on_its_steps_samples(run_dir, page, tmp_path, capsys):
    """Samples recorded without a gap of their own (an older run, a trainer that records none) get
    their step's, said to be the step's."""
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report.html"))
    with open(copy / "metrics.jsonl", "a", encoding="utf-8") as f:  # as a trainer with rollout log-probs logs it
        for step, gap in ((1, 0.002), (2, 1.5)):
            f.write(json.dumps({"step": step, "train/rollout_logprob_diff_max": gap}) + "\n")
    assert _report(capsys, copy)[0] == 0
    marked = Page((copy / "report.html").read_text(encoding="utf-8"))
    assert [t for t, _ in marked.tags].count("th") == 7
    by_step = {step: {cells[6] for attrs, cells in marked.rows if attrs["data-step"] == str(step)} for step in (1, 2, 4)}
    assert by_step == {1: {"0.002\nthe step's"}, 2: {"1.5\nthe step's\nlarge"}, 4: {"-"}}
    # nexrl show says it too, where large only
    from nexrl_core.cli import main

    assert main(["show", str(copy), "--last", "30"]) == 0
    heads = [block.splitlines()[0] for block in capsys.readouterr().out.strip().split("\n\n")[1:]]
    assert len(heads) == 30
    assert [h.endswith(" · step's log-prob gap 1.5 (large)") for h in heads] == [h.startswith("step 2 ") for h in heads]
    # without the metric (the mock trainer logs none) there is no such column
    assert [t for t, _ in Page(page.read_text()).tags].count("th") == 6


def with_sample_gaps(run_dir: Path, copy: Path, cap: float | None = None) -> list[dict]:
    """A copy of ``run_dir`` whose samples carry their own log-prob gaps, as nexrl_grpo's trainers
    record them: sample k of the file gets 0.05 * k at token k % 3 (segment 1 for every fifth),
    so samples 14 and up are above ln 2; with ``cap``, config.yaml sets algorithm.rollout_correction.cap."""
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report.html"))
    samples = rows(copy / "samples.jsonl")
    for k, sample in enumerate(samples):
        sample["logprob_gap"] = {"max": 0.05 * k, "position": k % 3, "token": f" t{k}\n"}
        if k % 5 == 0:
            sample["logprob_gap"]["segment"] = 1
    (copy / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if cap is not None:
        import yaml

        config = yaml.safe_load((copy / "config.yaml").read_text())
        config.setdefault("algorithm", {}).setdefault("rollout_correction", {})["cap"] = cap
        (copy / "config.yaml").write_text(yaml.safe_dump(config))
    return samples


def _where(k: int) -> str:
    """Where sample k's gap is, as show and report say it (the token's text JSON-quoted)."""
    return ("segment 1 " if k % 5 == 0 else "") + f'token {k % 3} " t{k}\\n"'


def test_each_samples_own_logprob_gap_is_shown_and_marked_where_large(run_dir, tmp_path, capsys):
    import math

    from nexrl_core.cli import main

    with_sample_gaps(run_dir, tmp_path / "copy")
    assert _report(capsys, tmp_path / "copy")[0] == 0
    marked = Page((tmp_path / "copy" / "report.html").read_text(encoding="utf-8"))
    assert [t for t, _ in marked.tags].count("th") == 7
    assert "f-gmin" in marked.texts  # the gap filter, with the column
    assert len(marked.rows) == 30
    for k, (attrs, cells) in enumerate(marked.rows):
        gap = 0.05 * k
        assert float(attrs["data-gap"]) == pytest.approx(gap)
        assert cells[6] == f"{gap:.3g}\n{_where(k)}" + ("\nlarge" if gap > math.log(2) else ""), k
    # nexrl show: the sample's own gap in its head, above ln 2 only
    assert main(["show", str(tmp_path / "copy"), "--last", "30"]) == 0
    heads = [block.splitlines()[0] for block in capsys.readouterr().out.strip().split("\n\n")[1:]]
    assert len(heads) == 30
    for k, head in enumerate(heads):
        large = 0.05 * k > math.log(2)
        assert ("log-prob gap" in head) == large, head
        assert not large or head.endswith(f" · log-prob gap {0.05 * k:.3g} at {_where(k)} (large)"), head
    assert sum("log-prob gap" in h for h in heads) == 16 and not any("step's" in h for h in heads)


def test_the_runs_own_correction_cap_sets_what_is_large(run_dir, tmp_path, capsys):
    from nexrl_core.cli import main

    with_sample_gaps(run_dir, tmp_path / "copy", cap=4.0)  # ln 4 = 1.386: samples 28 and 29 only
    assert main(["show", str(tmp_path / "copy"), "--last", "30"]) == 0
    heads = capsys.readouterr().out.strip().split("\n\n")[1:]
    assert [k for k, h in enumerate(heads) if "(large)" in h.splitlines()[0]] == [28, 29]
    assert _report(capsys, tmp_path / "copy")[0] == 0
    text = (tmp_path / "copy" / "report.html").read_text(encoding="utf-8")
    assert "above 1.39 (ln of algorithm.rollout_correction.cap: a token 4 times as likely" in text
    assert [k for k, (_, cells) in enumerate(Page(text).rows) if cells[6].endswith("\nlarge")] == [28, 29]


def test_a_missing_or_empty_run_dir_is_one_line(tmp_path, capsys):
    assert _report(capsys, tmp_path / "nowhere") == (2, "", f"error: {tmp_path / 'nowhere'}: no such run directory\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    message = (f"error: {empty}: nothing to report: no rows in metrics.jsonl or samples.jsonl (is it a run "
               f"directory? `run_dir` in the recipe)\n")
    assert _report(capsys, empty) == (2, "", message)
    (empty / "metrics.jsonl").write_text("")
    (empty / "samples.jsonl").write_text("{torn")
    assert _report(capsys, empty) == (2, "", message)
    (empty / "samples.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")  # an eval --out folder
    assert _report(capsys, empty, "-o", tmp_path) == (2, "", f"error: -o {tmp_path}: is a folder; give the HTML "
                                                             f"file to write\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert _report(capsys, empty, "-o", blocker / "r.html") == (2, "", f"error: -o {blocker / 'r.html'}: '{blocker}' "
                                                                       f"is a file, not a folder\n")
    assert _report(capsys, empty) == (0, f"{empty / 'report.html'}\n", "")
    assert "<polyline" not in (empty / "report.html").read_text() and "no metrics yet" in (empty / "report.html").read_text()


def test_svg_chart_draws_one_point_flat_lines_and_skips_infinite_values():
    one = svg_chart([{"label": "a", "points": [(3, 0.5)], "color": "#123456"}], "y")
    assert one.count("<circle") == 1 and "<polyline" in one
    flat = svg_chart([{"label": "a", "points": [(1, 2.0), (2, 2.0), (3, 1e308)], "color": "#123456"}], "y")
    polyline = flat.split('points="')[1].split('"')[0].split()
    assert len(polyline) == 2 and len({p.split(",")[1] for p in polyline}) == 1
    empty = svg_chart([{"label": "a", "points": [(1, -1e308)], "color": "#123456"}], "y")
    assert "no finite values" in empty and "<polyline" not in empty
    tiny_span = svg_chart([{"label": "a", "points": [(1, 1e10), (2, 1e10 + 1e-6)], "color": "#123456"}], "y")
    assert tiny_span.count("<polyline") == 1  # ticks below the values' float resolution still end
    many = svg_chart([{"label": "a", "points": [(i, float(i % 7)) for i in range(5000)], "color": "#123456"}], "y")
    assert len(many.split('points="')[1].split('"')[0].split()) <= 601


# ----------------------------------------------------------------------------- in a real browser


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium not installed (scripts/setup_env.sh installs Debian's chromium when run as root "
                    "with apt-get; otherwise: apt-get install chromium)")
    return path


def _browse(browser: str, url: str, proxy: RecordingProxy, profile: Path, *args: str) -> tuple[str, list[str]]:
    """Load ``url`` headless with every request (loopback too) sent to ``proxy``, so nothing leaves
    the machine: (stdout, the URLs the page itself asked for). The browser's own requests (sign-in,
    network time...) are told apart in its net log: they have no initiating origin."""
    net_log = profile / f"net-{len(os.listdir(profile)) if profile.is_dir() else 0}.json"
    profile.mkdir(exist_ok=True)
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio",
               f"--user-data-dir={profile / 'data'}", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--disable-default-apps", "--disable-extensions", "--no-pings",
               "--disable-features=NetworkTimeServiceQuerying,MediaRouter,OptimizationHints,Translate",
               f"--proxy-server=http://127.0.0.1:{proxy.port}", "--proxy-bypass-list=<-loopback>",
               f"--log-net-log={net_log}", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(profile)})
    assert done.returncode == 0, done.stderr[-2000:]
    log = json.loads(net_log.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    asked = [e["params"] for e in log["events"] if e["type"] == start and "url" in e.get("params", {})]
    return done.stdout, [p["url"] for p in asked if p.get("initiator") != "not an origin"
                         and urllib.parse.urlsplit(p["url"]).scheme not in ("file", "data", "chrome", "about")]


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA PNG (what chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color = header[:4]
    assert depth == 8 and color in (2, 6), header
    size = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * (3 if color == 2 else 4)
    out, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - size] if i >= size else 0
            up, corner = previous[i], previous[i - size] if i >= size else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        out.append(bytes(line))
        previous = line
    return width, size, out


def test_in_headless_chromium_the_plots_render_the_filter_works_and_nothing_is_fetched(run_dir, page, proxy,
                                                                                        tmp_path):
    browser = _chromium()
    samples = rows(run_dir / "samples.jsonl")
    profile = tmp_path / "profile"

    # the check itself: a page that fetches is caught, by the proxy and in the net log
    leak = tmp_path / "leak.html"
    leak.write_text(f'<!DOCTYPE html><img src="http://127.0.0.1:{proxy.port}/leak.png"><p>x</p>')
    proxy.requests.clear()
    _, asked = _browse(browser, leak.as_uri(), proxy, profile, "--dump-dom")
    assert asked == [f"http://127.0.0.1:{proxy.port}/leak.png"]
    assert f"GET http://127.0.0.1:{proxy.port}/leak.png HTTP/1.1" in proxy.requests
    proxy.requests.clear()

    # the plots: the training reward's colour drawn (a screenshot of the page's top)
    shot = tmp_path / "shot.png"
    _, asked_shot = _browse(browser, page.as_uri(), proxy, profile, f"--screenshot={shot}", "--window-size=1000,900",
            "--hide-scrollbars")
    width, size, lines = _png_pixels(shot)
    blue = bytes(int(_PALETTE[0][i:i + 2], 16) for i in (1, 3, 5))
    drawn = sum(1 for line in lines for x in range(width) if line[x * size:x * size + 3] == blue)
    assert drawn > 300, f"{drawn} pixels of the reward line's colour"

    # the filter, from the address's fragment: text (any case), steps, a reward bound
    query = {"text": "IMG SRC", "step": "2-4", "rmin": "0.5"}
    dom, asked_filtered = _browse(browser, f"{page.as_uri()}#{urllib.parse.urlencode(query)}", proxy, profile,
                                  "--dump-dom")
    shown = Page(dom)
    assert len(shown.rows) == len(samples)
    visible = [i for i, (attrs, _) in enumerate(shown.rows) if "hidden" not in attrs]

    def matching(text=None, step=None, rmin=None):
        return [i for i, s in enumerate(samples)
                if (text is None or text.lower() in (_prompt_text(s["prompt"]) + "\n" + s["response"]).lower())
                and (step is None or step[0] <= s["step"] <= step[1])
                and (rmin is None or s["reward"] >= rmin)]

    expected = matching("IMG SRC", (2, 4), 0.5)
    assert visible == expected and len(expected) == 8  # "1 + 2 <img…" and "2 + 2 <img…" at steps 2 and 4
    # each field leaves out rows the other two keep
    for wider in (matching(None, (2, 4), 0.5), matching("IMG SRC", None, 0.5), matching("IMG SRC", (2, 4), None)):
        assert set(wider) > set(expected)
    assert shown.texts["f-count"] == f"8 of {len(samples)} samples"
    junk = JUNK.format(port=proxy.port)
    assert sum(junk in cells[4] for _, cells in shown.rows) == 18  # the junk is text in the browser's DOM too
    assert shown.count("img") == 0 and shown.count("script") == 1

    # the page asked for nothing: not the junk's image or script, no font, no style sheet
    assert asked_shot == [] and asked_filtered == []
    assert not [r for r in proxy.requests if f"127.0.0.1:{proxy.port}" in r], proxy.requests


def test_in_headless_chromium_the_gap_filter_keeps_the_samples_at_or_above_it(run_dir, proxy, tmp_path):
    browser = _chromium()
    copy = tmp_path / "copy"
    samples = with_sample_gaps(run_dir, copy)
    done = nexrl(copy.parent, "report", copy, env=_env(copy.parent))
    assert done.returncode == 0, done.stderr
    proxy.requests.clear()
    query = {"gmin": "0.7", "step": "1-2"}
    dom, asked = _browse(browser, f"{(copy / 'report.html').as_uri()}#{urllib.parse.urlencode(query)}", proxy,
                         tmp_path / "profile", "--dump-dom")
    shown = Page(dom)
    visible = [k for k, (attrs, _) in enumerate(shown.rows) if "hidden" not in attrs]
    want = [k for k, s in enumerate(samples) if 0.05 * k >= 0.7 and s["step"] <= 2]
    assert visible == want and want == list(range(14, 20))  # step 2's samples from the 15th of the file on
    assert shown.texts["f-count"] == f"6 of {len(samples)} samples"
    assert asked == []
