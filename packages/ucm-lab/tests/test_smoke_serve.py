"""The installation smoke check's arguments, settings and verdicts (no engine: ``nox -s
smoke_wheels`` runs the check itself)."""

from __future__ import annotations

import json

import pytest
from ucm.lab.vllm import smoke_serve
from ucm.lab.vllm.smoke_serve import (
    DUMPED,
    HIT_TOKENS,
    LOAD_ERRORS,
    LOADED,
    cold_problems,
    expected_hit,
    parse_args,
    prompt_text,
    serve_args,
    warm_problems,
)


def test_defaults():
    args = parse_args([])
    assert (args.tokens, args.store, args.keep) == (600, None, False)


@pytest.mark.parametrize("tokens", ["256", "0", "-5", "4001"])
def test_a_prompt_without_a_whole_stored_block_or_past_the_model_is_refused(tokens, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--tokens", tokens])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--tokens must be more than one stored block (256) and at most 4000" in err
    assert err.rstrip().endswith(f"got {tokens}")


def test_the_hit_is_the_prompts_whole_blocks_short_of_its_last_token():
    assert expected_hit(600) == 512
    assert expected_hit(257) == 256
    assert expected_hit(512) == 256  # vLLM computes the last token: block 2 is not loaded
    assert expected_hit(513) == 512


def test_the_prompt_is_one_token_a_word_for_the_word_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer
    from ucm.lab.testing.vllm.models import make_word_tokenizer

    text = prompt_text(600)
    assert text == prompt_text(600) != prompt_text(600, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(str(make_word_tokenizer(tmp_path)))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == 600 and tokenizer.unk_token_id not in ids


def test_the_servers_settings_are_the_connectors_on_a_posix_store(tmp_path):
    from ucm.vllm.config import connector_config

    args = serve_args("TOKENIZER", str(tmp_path))
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "UCMConnector"
    assert transfer["kv_connector_module_path"] == "ucm.vllm"
    config = connector_config(transfer["kv_connector_extra_config"])
    assert config.store.kind == "posix" and str(config.store.path) == str(tmp_path)
    assert config.block_tokens == smoke_serve.BLOCK_TOKENS  # the hit the check expects
    assert "--enable-prompt-tokens-details" in args  # else the answer reports no cached tokens


HIT = 512
GOOD = {"usage": {"prompt_tokens": 600, "prompt_tokens_details": {"cached_tokens": HIT}}}
LOADED_ALL = {HIT_TOKENS: HIT, LOADED: 2, LOAD_ERRORS: 0}


def test_a_fresh_server_that_loaded_every_stored_block_passes():
    assert warm_problems(GOOD, LOADED_ALL, HIT) == []
    assert cold_problems({DUMPED: 2}, 2) == []


def test_each_thing_a_fresh_server_missed_is_named():
    cold = {"usage": {"prompt_tokens": 600, "prompt_tokens_details": None}}
    problems = warm_problems(cold, {}, HIT)
    assert len(problems) == 3
    assert "reported 0 cached prompt tokens, expected 512" in problems[0]
    assert HIT_TOKENS in problems[1] and LOADED in problems[2]
    errors = warm_problems(GOOD, {**LOADED_ALL, LOAD_ERRORS: 1}, HIT)
    assert errors == ["the fresh server had 1 load errors"]
    assert cold_problems({}, 2) == [f"the first server dumped 0 blocks, expected 2 ({DUMPED})"]
