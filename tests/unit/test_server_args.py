"""pipeline-serve flags that are parsed beyond argparse's types."""

from __future__ import annotations

import os

import pytest

from pipeline.common.flags import parse_cpu_list
from pipeline.server_args import build_parser
from pipeline.server_config import make_config


def test_cpu_lists():
    assert parse_cpu_list("", "--worker-cpus") == ()
    assert parse_cpu_list("0", "--worker-cpus") == (0,)
    if len(os.sched_getaffinity(0)) >= 2:
        assert parse_cpu_list("1,0", "--worker-cpus") == (0, 1)
        assert parse_cpu_list("0-1", "--worker-cpus") == (0, 1)


@pytest.mark.parametrize("text", ["a", "0-x", "1-", ",", "99999"])
def test_bad_cpu_lists_exit_with_a_message(text, capsys):
    with pytest.raises(SystemExit):
        parse_cpu_list(text, "--worker-cpus")
    assert "--worker-cpus" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "-tp", "2"],
            "--node-rank 2 is not a node",
        ),
        (["--node-rank", "-1"], "--node-rank -1 is not a node"),
        (["--nnodes", "0"], "--nnodes must be positive"),
        (["--nnodes", "2", "--master-addr", "127.0.0.1", "-tp", "3"], "--nnodes 2 does not divide"),
        (["--nnodes", "2", "-tp", "2"], "needs --master-addr"),
        (["--nnodes", "2", "--master-addr", "h", "--master-port", "70000", "-tp", "2"], "is not a TCP port"),
        (["--nnodes", "2", "--master-addr", "h", "-tp", "2", "-dp", "2"], "does not combine with --data-parallel"),
    ],
)
def test_bad_node_combinations_exit_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_config(build_parser().parse_args(["--model", "sim", *flags]))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_node_layout():
    """Node 1 of 2 at -tp 4 runs ranks 2 and 3, meets at the head's TCP store and has no ring to read."""
    args = ["--model", "sim", "-tp", "4", "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "1234"]
    head = make_config(build_parser().parse_args(args))
    node1 = make_config(build_parser().parse_args([*args, "--node-rank", "1"]))
    assert (head.is_head, list(head.local_ranks), head.ranks_per_node) == (True, [0, 1], 2)
    assert (node1.is_head, list(node1.local_ranks)) == (False, [2, 3])
    assert node1.tp_init_method == "tcp://10.0.0.1:1234"
    assert [node1.device_index(r) for r in node1.local_ranks] == [0, 1]
    one = make_config(build_parser().parse_args(["--model", "sim", "-tp", "4"]))
    assert one.tp_init_method.startswith("file://") and list(one.local_ranks) == [0, 1, 2, 3]
    for c in (head, node1, one):
        os.rmdir(c.ipc_dir)


def test_speculative_config_takes_vllms_shape():
    def spec(text):
        return make_config(build_parser().parse_args(["--model", "sim", "--speculative-config", text])).speculative

    s = spec('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 4, 2, 5)
    # vLLM's defaults: both bounds 5, or one bound given sets the other.
    assert (spec('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_min, 5) == (5, 5)
    assert spec('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}').prompt_lookup_min == 2
    assert spec('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3}').prompt_lookup_max == 3
    assert make_config(build_parser().parse_args(["--model", "sim"])).speculative is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram, draft_model"),
        ('{"method": "ngram"}', "num_speculative_tokens must be an integer from 1 to 32"),
        ('{"method": "ngram", "num_speculative_tokens": 33}', "num_speculative_tokens must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min must be"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}', "unsupported key"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "method draft_model needs model"),
        ('{"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "are for method ngram only"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model is for method draft_model only"),
    ],
)
def test_bad_speculative_configs_exit_naming_the_key(text, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_config(build_parser().parse_args(["--model", "sim", "--speculative-config", text]))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _draft_config(target, draft, *flags):
    text = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 3}}'
    args = ["--model", str(target), "--kv-cache-memory", "0.01", "--speculative-config", text, *flags]
    return make_config(build_parser().parse_args(args))


def test_a_draft_model_is_resolved_and_its_cache_counted(tiny_dir, smol_dir, tmp_path):
    from tests.conftest import make_tiny_llama

    draft = make_tiny_llama(tmp_path / "draft", smol_dir, num_hidden_layers=1)
    cfg = _draft_config(tiny_dir, draft)
    assert (cfg.speculative.method, cfg.speculative.model, cfg.speculative.num_speculative_tokens) == (
        "draft_model", str(draft), 3
    )  # fmt: skip
    alone = make_config(build_parser().parse_args(["--model", str(tiny_dir), "--kv-cache-memory", "0.01"]))
    # The target's 2 layers and the draft's 1, of the same shape, share each block's bytes.
    assert cfg.num_kv_blocks == alone.num_kv_blocks * 2 // 3


def test_a_draft_model_with_another_vocabulary_is_refused_naming_both(tiny_dir, smol_dir, tmp_path, capsys):
    import json
    import shutil

    from tests.conftest import make_tiny_llama

    small = make_tiny_llama(tmp_path / "small-vocab", smol_dir, vocab_size=1000)
    with pytest.raises(SystemExit) as e:
        _draft_config(tiny_dir, small)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "vocabulary of 1000 tokens" in err and str(small) in err and str(tiny_dir) in err
    # The same size, two tokens swapped.
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit):
        _draft_config(tiny_dir, swapped)
    err = capsys.readouterr().err
    assert "map token ids to other tokens" in err and str(swapped) in err and str(tiny_dir) in err
    with pytest.raises(SystemExit):
        _draft_config(tiny_dir, tmp_path / "absent")
    assert "draft model: model" in capsys.readouterr().err
    short = make_tiny_llama(tmp_path / "short", smol_dir, max_position_embeddings=64)
    with pytest.raises(SystemExit):
        _draft_config(tiny_dir, short, "--max-model-len", "128")
    assert "max_position_embeddings 64, below --max-model-len 128" in capsys.readouterr().err


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoint_dtype_on_cuda(tiny_dir, tmp_path):
    import json
    import shutil

    from pipeline.common.model_files import checkpoint_dtype, read_model_config

    config = make_config(build_parser().parse_args(["--model", str(tiny_dir), "--device", "cpu"]))
    assert config.dtype == "float32"
    assert make_config(build_parser().parse_args(["--model", str(tiny_dir), "--dtype", "float16"])).dtype == "float16"
    # What CUDA would run: config.json's dtype, else most of the first file's tensors'.
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    assert checkpoint_dtype(d, read_model_config(d)) == "bfloat16"
    del cfg["dtype"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_dtype(d, read_model_config(d)) == "float32"  # the tiny model's tensors


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trust-remote-code"], "--trust-remote-code is not supported: this server never runs modelling code"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
        (["--chat-template", "/nonexistent/template.jinja"], "--chat-template '/nonexistent/template.jinja' cannot"),
    ],
)
def test_model_flags_that_cannot_work_exit_with_a_message(tiny_dir, flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_config(build_parser().parse_args(["--model", str(tiny_dir), "--device", "cpu", *flags]))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_cache_sizing_on_cpu_keeps_2_gib_and_cuda_leaves_it_to_the_workers(tiny_dir, tmp_path):
    default = make_config(build_parser().parse_args(["--model", str(tiny_dir), "--device", "cpu"]))
    explicit = make_config(
        build_parser().parse_args(["--model", str(tiny_dir), "--device", "cpu", "--kv-cache-memory", "2"])
    )
    assert default.num_kv_blocks == explicit.num_kv_blocks > 0
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    config = make_config(
        build_parser().parse_args(["--model", str(tiny_dir), "--device", "cpu", "--chat-template", str(template)])
    )
    assert config.chat_template == "{{ messages[0]['content'] }}"


def test_help_explains_the_model_flags():
    text = " ".join(build_parser().format_help().split())
    for phrase in (
        "--dtype {auto,float32,bfloat16,float16}",
        "on CUDA the checkpoint's",
        "--gpu-memory-utilization",
        "profiling step of --max-num-batched-tokens",
        "--chat-template FILE",
        "--trust-remote-code Refused",
    ):
        assert phrase in text, phrase
