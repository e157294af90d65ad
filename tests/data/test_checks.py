"""Bad data and sample settings are refused before any process starts, in one line (mlplat.data.checks and the
config's sample section)."""
from __future__ import annotations

import pytest

from tests.helpers.data import byte_prefix, gpt2_available
from tests.helpers.paths import CONF


@pytest.fixture(scope="module")
def hydra_conf():
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _refusal(*overrides: str) -> str:
    from hydra import compose

    from mlplat.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(compose(config_name="config", overrides=["parallel=single", *overrides]))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_data_and_sample_settings_are_one_line(hydra_conf, tmp_path):
    from hydra import compose

    from mlplat.config import load_config

    prefix = byte_prefix(tmp_path / "small", n_docs=40, doc_len=30)  # 1200 tokens: 9 windows of 128
    big = byte_prefix(tmp_path / "big", n_docs=1000, doc_len=100)
    ok = load_config(compose(config_name="config", overrides=["parallel=single", "data=indexed",
                                                              f"data.prefix={big}", "data.tokenizer=byte"]))
    assert ok.model.vocab_size == 256
    cases = {
        ("data=indexed",): ["data.prefix=PREFIX"],
        ("data=indexed", f"data.prefix={tmp_path / 'nope'}", "data.tokenizer=byte"): ["does not exist"],
        ("data=indexed", f"data.prefix={prefix}", "data.tokenizer=byte"):
            ["too small", "training split", "gives 9 windows"],
        ("data=indexed", f"data.blend=[0.3,{big},-1,{big}]", "data.tokenizer=byte"): ["weight -1", "positive"],
        ("data=indexed", f"data.blend=[0.3,{big},0.7]", "data.tokenizer=byte"): ["pairs"],
        ("data=indexed", f"data.prefix={big}",): ["data.tokenizer=null", "PREFIX.meta.json"],
        ("data=indexed", f"data.prefix={big}", "data.tokenizer=byte", "data.split=[1,2]"): ["data.split"],
        ("data=indexed", f"data.prefix={big}", "data.tokenizer=/nope/tok.json"): ["data.tokenizer=/nope/tok.json"],
        ("sample.temperature=-1",): ["sample.temperature=-1"],
        ("sample.top_k=-2",): ["sample.top_k=-2"],
        ("sample.top_p=0",): ["sample.top_p=0"],
    }
    if gpt2_available():
        cases[("data.tokenizer=gpt2", "model.vocab_size=256")] = ["model.vocab_size=256", "50257"]
    for overrides, fragments in cases.items():
        message = _refusal(*overrides)
        for fragment in fragments:
            assert fragment in message, (overrides, message)
