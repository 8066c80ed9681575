"""The explorer page in real headless Chromium: what a user does (type, press Enter, move the slider, click) and
what they see (cells drawn, values equal to the API's), with no console errors and no request off this machine."""

from __future__ import annotations

import json
import math
import urllib.request

import pytest

from oneblock.explore.analysis import unpack
from oneblock.explore.page import write_html

pytest.importorskip("uvicorn")
try:  # without playwright the browser fixture skips these tests, or fails them under CI=true
    from playwright.sync_api import expect
except ImportError:
    expect = None

SENTENCE = "The quick brown fox jumps."
READY = "#status[data-state=ready]"


def api(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        server.url + path.lstrip("/"), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def open_and_type(page, server, text: str, target: str | None = None) -> None:
    page.goto(server.url)
    page.wait_for_selector(READY, timeout=20_000)
    if target is not None:
        page.fill("#target", target)
    page.fill("#text", text)
    page.press("#text", "Enter")
    page.wait_for_selector(f"#tokens .token >> nth={len(text.encode()) - 1}", timeout=20_000)
    page.wait_for_selector(READY, timeout=20_000)
    expect(page.locator("#tokens .token")).to_have_count(len(text.encode()))


def cell_value(page, row: int, col: int) -> float:
    return float(page.get_attribute(f'#heatmap .cell[data-row="{row}"][data-col="{col}"]', "data-value"))


def only_local(page) -> None:
    assert page.seen, "the page made no requests at all"
    assert all(url.startswith("http://127.0.0.1:") for url in page.seen), page.seen
    assert page.errors == []


def test_typed_sentence_draws_t_by_t_causal_cells_with_the_apis_values(decoder, live, page, tmp_path):
    server = live(decoder)
    open_and_type(page, server, SENTENCE)
    t = len(SENTENCE)
    assert page.locator("#heatmap .cell").count() == t * t
    assert page.locator("#heatmap .cell.masked").count() == t * (t - 1) // 2  # the causal triangle
    assert page.locator("#heatmap .row-label").count() == t == page.locator("#heatmap .col-label").count()
    weights = unpack(api(server, "/api/analyze", {"text": SENTENCE})["attention"][0]["weights"])  # (L, H, T, T)
    for row, col in [(0, 0), (5, 2), (t - 1, t - 1), (t - 1, 3), (2, 7)]:
        assert cell_value(page, row, col) == float(weights[0, 0, row, col])
    page.select_option("#attn-layer", "1")
    page.select_option("#attn-head", "2")
    page.wait_for_selector('#heatmap[data-layer="1"][data-head="2"]')
    assert cell_value(page, t - 1, 4) == float(weights[1, 2, t - 1, 4])
    assert page.locator("#checks .check.pass").count() == page.locator("#checks .check").count() > 0
    page.screenshot(path=str(tmp_path / "explore.png"), full_page=True)
    assert (tmp_path / "explore.png").stat().st_size > 10_000
    only_local(page)


def test_temperature_slider_moves_the_bars_as_softmax_predicts(decoder, live, page):
    server = live(decoder)
    open_and_type(page, server, SENTENCE)
    logits = unpack(api(server, "/api/analyze", {"text": SENTENCE})["next_token"]["logits"]).double()
    before = [float(p) for p in page.eval_on_selector_all("#bars .bar", "rows => rows.map(r => r.dataset.prob)")]
    page.fill("#temperature", "0.35")
    page.wait_for_selector('#bars[data-temperature="0.35"]')
    ids = [int(i) for i in page.eval_on_selector_all("#bars .bar", "rows => rows.map(r => r.dataset.id)")]
    shown = [float(p) for p in page.eval_on_selector_all("#bars .bar", "rows => rows.map(r => r.dataset.prob)")]
    probs = (logits / 0.35).softmax(-1)
    assert ids == probs.topk(len(ids)).indices.tolist()
    for got, want in zip(shown, probs[ids].tolist(), strict=True):
        assert math.isclose(got, want, rel_tol=1e-5)
    assert shown[0] > before[0]  # a colder softmax: the favourite gains
    assert page.inner_text("#temperature-value") == "0.35"
    only_local(page)


def test_generate_button_appends_a_token(decoder, live, page):
    server = live(decoder)
    open_and_type(page, server, SENTENCE)
    expected = api(server, "/api/generate", {"text": SENTENCE, "greedy": True})["appended"]
    page.click("#generate")
    expect(page.locator("#tokens .token")).to_have_count(len(SENTENCE) + 1)  # no eval: the page forbids it
    page.wait_for_selector(READY)
    assert page.get_attribute("#tokens .token >> nth=-1", "data-id") == str(expected["id"])
    assert page.locator("#heatmap .cell").count() == (len(SENTENCE) + 1) ** 2
    assert "appended" in page.inner_text("#generate-note")
    only_local(page)


def test_encoder_maps_are_full_and_there_is_no_next_token(encoder, live, page):
    server = live(encoder)
    open_and_type(page, server, SENTENCE)
    t = len(SENTENCE)
    assert page.locator("#heatmap .cell").count() == t * t
    assert page.locator("#heatmap .cell.masked").count() == 0
    assert "no LM head" in page.inner_text("#next-note")
    assert page.locator("#bars .bar").count() == 0
    assert page.is_hidden("#generate-controls")
    rows = page.locator("#differences tr.difference")  # the card's rows: an encoder, post-LN
    expect(rows).to_have_count(2)
    assert rows.nth(0).get_attribute("data-key") == "arch"
    assert "encoder-only" in rows.nth(0).inner_text()
    assert rows.nth(1).locator("td.count").inner_text() == "-72"  # no final LayerNorm: gamma and beta of 36
    only_local(page)


def test_encoder_decoder_shows_the_t_by_s_cross_attention(seq2seq, live, page):
    server = live(seq2seq)
    open_and_type(page, server, SENTENCE, target="Fox!")
    page.select_option("#attn-group", "cross")
    page.wait_for_selector('#heatmap[data-rows="4"]')
    assert page.locator("#heatmap .cell").count() == 4 * len(SENTENCE)
    assert page.locator("#heatmap .cell.masked").count() == 0
    weights = unpack(api(server, "/api/analyze", {"text": SENTENCE, "target": "Fox!"})["attention"][2]["weights"])
    assert cell_value(page, 3, len(SENTENCE) - 1) == float(weights[0, 0, 3, len(SENTENCE) - 1])
    assert page.locator(".box.cross_attention").count() == 1  # the decoder block's third sublayer
    only_local(page)


def test_static_html_renders_the_same_maps_without_a_server(decoder, browser, tmp_path):
    path = write_html(decoder, tmp_path / "report.html", SENTENCE)
    context = browser.new_context(offline=True)
    page = context.new_page()
    errors, seen = [], []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("request", lambda request: seen.append(request.url))
    page.goto(path.as_uri())
    page.wait_for_selector(READY, timeout=20_000)
    t = len(SENTENCE)
    assert page.locator("#heatmap .cell").count() == t * t
    html = path.read_text()
    start = html.index('id="explore-data">') + len('id="explore-data">')
    data = json.loads(html[start : html.index("</script>", start)])
    weights = unpack(data["analysis"]["attention"][0]["weights"])
    for row, col in [(0, 0), (t - 1, 2), (9, 9)]:
        assert cell_value(page, row, col) == float(weights[0, 0, row, col])
    with_server = unpack(_analysis_via_client(decoder)["attention"][0]["weights"])
    assert (with_server == weights).all()  # the file holds what the server would send
    page.fill("#temperature", "2")
    page.wait_for_selector('#bars[data-temperature="2"]')
    assert page.is_hidden("#generate-controls") and page.is_hidden("#run")
    assert seen == [path.as_uri()] and errors == []
    context.close()


def _analysis_via_client(explorable) -> dict:
    from starlette.testclient import TestClient

    from oneblock.explore.server import create_app

    test_client = TestClient(create_app(explorable), base_url="http://127.0.0.1:8000")
    return test_client.post("/api/analyze", json={"text": SENTENCE}).json()


def test_text_that_looks_like_html_stays_text(decoder, live, page):
    server = live(decoder)
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    text = "<img src=x onerror=alert(1)><b>hi</b>"
    open_and_type(page, server, text)
    assert page.locator("#tokens img, #tokens b, #heatmap img, #lens img").count() == 0
    assert "".join(
        page.eval_on_selector_all("#tokens .piece", "nodes => nodes.map(n => n.textContent)")
    ) == text.replace(" ", "\u00b7")  # spaces are drawn as middle dots
    assert dialogs == []
    only_local(page)


def test_a_bad_request_shows_the_servers_message(decoder, live, page):
    server = live(decoder)
    page.goto(server.url)
    page.wait_for_selector(READY, timeout=20_000)
    page.fill("#text", "x" * 200)  # more tokens than the tiny model's context of 96
    page.press("#text", "Enter")
    page.wait_for_selector("#status[data-state=error]")
    assert "200 tokens long; the limit is 96 tokens" in page.inner_text("#error")
    assert page.locator("#heatmap .cell").count() == 44 * 44  # the last good analysis stays on screen
