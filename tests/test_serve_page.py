"""The playground page (GET /) in a real headless Chromium: the system's `chromium` and
`chromidriver` (scripts/install_browser.sh installs them; nothing downloads a browser), driven by
selenium. The page loads without console errors, and at temperature 0 it shows the API's greedy
completion (prompt mode) and chat answer (chat mode), with the token count.

PLAYGROUND_SCREENSHOT=docs/playground.png saves the screenshot the README shows."""
from __future__ import annotations

import os

import pytest

from mesh_transformer.serve import create_app
from tests.serving import KEY, engine, start_server  # noqa: F401

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-proxy-server", "--disable-dev-shm-usage", "--window-size=1200,760"]


@pytest.fixture(scope="module")
def page_url(engine):
    server, base = start_server(create_app(engine, model_name="gpt-j-tiny-random", api_key=KEY))
    yield base
    server.should_exit = True


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        if os.environ.get("CI") == "true":
            pytest.fail("no system Chromium: scripts/test.sh runs scripts/install_browser.sh first")
        pytest.skip("no system Chromium (run scripts/install_browser.sh)")
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must not look for browsers online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def console_errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def fill(driver, element_id: str, text: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(text)


def run_and_wait(driver) -> str:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element("id", "generate").click()
    WebDriverWait(driver, 60).until(lambda d: d.find_element("id", "status").text in ("done", "stopped")
                                    or "error" in d.find_element("id", "status").get_attribute("class"))
    return driver.find_element("id", "status").text


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def test_playground_prompt_and_chat_at_temperature_0_show_the_api_answers(browser, page_url, tmp_path):
    from openai import OpenAI

    api = OpenAI(base_url=f"{page_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    browser.get(page_url + "/")
    assert browser.title == "mesh-transformer playground"
    assert text_of(browser, "model") == "gpt-j-tiny-random"
    assert not browser.find_element("id", "model-choice").is_displayed()  # no adapters: nothing to choose
    assert console_errors(browser) == []

    expected = api.completions.create(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0)
    fill(browser, "api-key", KEY)
    fill(browser, "prompt", "The quick brown")
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "12")
    assert run_and_wait(browser) == "done"
    assert text_of(browser, "output") == expected.choices[0].text != ""
    assert text_of(browser, "tokens") == str(expected.usage.completion_tokens)
    assert float(text_of(browser, "tps")) > 0 and text_of(browser, "finish") == expected.choices[0].finish_reason
    shot = os.environ.get("PLAYGROUND_SCREENSHOT") or str(tmp_path / "playground.png")
    assert browser.save_screenshot(shot) and os.path.getsize(shot) > 10_000

    browser.find_element("id", "mode-chat").click()
    fill(browser, "user", "hi")
    fill(browser, "max-tokens", "8")
    assert run_and_wait(browser) == "done"
    answer = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                         temperature=0).choices[0].message.content
    roles = browser.execute_script("return [...document.querySelectorAll('#chat-log .role')].map(e => e.textContent)")
    assert roles == ["user", "assistant"]
    replies = browser.execute_script(
        "return [...document.querySelectorAll('#chat-log .assistant div:last-child')].map(e => e.textContent)")
    assert replies == [answer]
    assert console_errors(browser) == []


def test_playground_shows_api_errors(browser, page_url):
    browser.get(page_url + "/")
    fill(browser, "api-key", KEY)
    fill(browser, "prompt", "The quick brown")
    fill(browser, "max-tokens", "1000")
    run_and_wait(browser)
    assert "max_tokens must be at most 31" in browser.find_element("id", "status").text
    # the 400 itself is the only console entry (Chromium logs failed fetches)
    assert all("400" in e["message"] for e in console_errors(browser))


@pytest.fixture(scope="module")
def lora_page_url(tiny, tmp_path_factory):
    """The tiny model served with a LoRA adapter 'chat' (`--lora-modules`), in a bank of one entry,
    and runtime loading on -> (url, adapter directories: chat, and code to load)."""
    pytest.importorskip("peft")
    from mesh_transformer import loading
    from mesh_transformer.serve import Engine
    from tests.helpers import save_peft_adapters
    dirs = save_peft_adapters(tiny.path, type(tiny.torch), {"chat": (4, 32, ["q_proj", "fc_out"]),
                                                       "code": (2, 16, ["q_proj"])},
                              tmp_path_factory.mktemp("page_adapter"))
    gen = loading.load(hf=str(tiny.path), dtype="float32", mp=1, dp=1).generator(adapters=[("chat", dirs["chat"])])
    engine = Engine(gen, tiny.tokenizer, max_batch=4, chunk=4).start()
    server, base = start_server(create_app(engine, model_name="gpt-j-tiny-random", api_key=KEY, runtime_lora=True))
    yield base, dirs
    server.should_exit = True
    engine.stop()


def test_playground_chooses_a_lora_adapter(browser, lora_page_url):
    """With adapters served, the page offers the base and each adapter; choosing one sends its name
    as `model`, and the page shows that adapter's greedy completion (not the base's). An adapter
    loaded at runtime joins the list when it gets focus."""
    import httpx
    from openai import OpenAI
    from selenium.webdriver.support.ui import Select, WebDriverWait

    lora_page_url, dirs = lora_page_url
    api = OpenAI(base_url=f"{lora_page_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    expected = {m: api.completions.create(model=m, prompt="The quick brown", max_tokens=12, temperature=0)
                .choices[0].text for m in ("gpt-j-tiny-random", "chat")}
    assert expected["chat"] != expected["gpt-j-tiny-random"]
    browser.get(lora_page_url + "/")
    choice = Select(browser.find_element("id", "model-choice"))
    assert [o.text for o in choice.options] == ["gpt-j-tiny-random", "chat"]
    fill(browser, "api-key", KEY)
    fill(browser, "prompt", "The quick brown")
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "12")
    for model in ("chat", "gpt-j-tiny-random"):
        choice.select_by_visible_text(model)
        assert run_and_wait(browser) == "done"
        assert text_of(browser, "output") == expected[model]
    r = httpx.post(f"{lora_page_url}/v1/load_lora_adapter", json={"lora_name": "code", "lora_path": str(dirs["code"])},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    expected["code"] = api.completions.create(model="code", prompt="The quick brown", max_tokens=12,
                                              temperature=0).choices[0].text
    assert expected["code"] not in (expected["chat"], expected["gpt-j-tiny-random"])
    choice.select_by_visible_text("chat")
    browser.find_element("id", "model-choice").click()  # focus: the list is read again
    WebDriverWait(browser, 10).until(lambda b: len(Select(b.find_element("id", "model-choice")).options) == 3)
    choice = Select(browser.find_element("id", "model-choice"))
    assert [o.text for o in choice.options] == ["gpt-j-tiny-random", "chat", "code"]
    assert choice.first_selected_option.text == "chat"  # the choice made stays
    choice.select_by_visible_text("code")
    assert run_and_wait(browser) == "done"
    assert text_of(browser, "output") == expected["code"]
    assert console_errors(browser) == []


@pytest.fixture(scope="module")
def classifier_page_url(tiny, tmp_path_factory):
    """The tiny GPT-J as a three-label sequence classifier (saved by transformers), served ->
    (url, the torch model)."""
    from mesh_transformer import loading
    from mesh_transformer.io import hf
    from mesh_transformer.serve import Engine
    from tests.helpers import hf_classifier
    path = tmp_path_factory.mktemp("page_classifier")
    model = hf_classifier(tiny.torch, 3, path, names=["negative", "neutral", "positive"])
    tiny.tokenizer.save_pretrained(path)
    engine = Engine(loading.load(hf=str(path), dtype="float32", mp=1, dp=1).generator(), tiny.tokenizer).start()
    server, base = start_server(create_app(engine, model_name="sentiment", api_key=KEY, labels=hf.label_names(path)))
    yield base, model
    server.should_exit = True


def test_playground_classifies_on_a_classifiers_server(browser, classifier_page_url, tiny):
    """A classifier's page offers Classify alone (no prompt, chat or sampling settings) and shows each
    label's probability and logit: transformers' softmax and logits, the likeliest label in bold."""
    import numpy as np
    import torch
    from selenium.webdriver.support.ui import WebDriverWait

    base, model = classifier_page_url
    browser.get(base + "/")
    shown = {b: browser.find_element("id", b).is_displayed() for b in ("mode-prompt", "mode-chat", "mode-classify",
                                                                         "max-tokens", "stop", "output")}
    assert shown == {"mode-prompt": False, "mode-chat": False, "mode-classify": True, "max-tokens": False,
                     "stop": False, "output": False}
    assert browser.find_element("id", "generate").text == "Classify"
    fill(browser, "api-key", KEY)
    fill(browser, "text", "The quick brown fox")
    browser.find_element("id", "generate").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element("id", "status").text == "done")
    rows = browser.execute_script("return [...document.querySelectorAll('#scores tbody tr')].map(r => "
                                  "[...r.cells].map(c => c.textContent).concat([r.style.fontWeight]))")
    with torch.no_grad():
        logits = model(torch.tensor([tiny.tokenizer.encode("The quick brown fox")])).logits[0].numpy()
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    best = int(np.argmax(logits))
    assert rows == [[name, f"{probs[i]:.4f}", "", f"{logits[i]:.4f}", "600" if i == best else ""]
                    for i, name in enumerate(["negative", "neutral", "positive"])]
    assert console_errors(browser) == []
