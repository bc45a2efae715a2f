"""Settings validation: every bad value stops start-up with one line naming the setting."""

from __future__ import annotations

import json

import pytest

from conftest import run_python
from sglang_hs.config import ENV_VAR, HieraSparseConfig, HieraSparseConfigError


@pytest.mark.parametrize(
    "values, flag",
    [
        ({"sk_prefill": 1.5}, "--hierasparse-sk-prefill"),
        ({"sv_decode": -0.1}, "--hierasparse-sv-decode"),
        ({"block_size": 48}, "--hierasparse-block-size"),
        ({"sink_tokens": 100}, "--hierasparse-sink-tokens"),
        ({"window_tokens": -64}, "--hierasparse-window-tokens"),
        ({"pruner": "random"}, "--hierasparse-pruner"),
        ({"store_fraction": 0.0}, "--hierasparse-store-fraction"),
        ({"host_store_fraction": 0.99}, "--hierasparse-host-store-fraction"),
        ({"dense_backend": "fa3"}, "--hierasparse-dense-backend"),
        ({"kernels": "decode,prefill"}, "--hierasparse-kernels"),
        ({"kernels": "decode,decode"}, "--hierasparse-kernels"),
        ({"kernels": ""}, "--hierasparse-kernels"),
        ({"shared_prefix_decode": "yes"}, "--hierasparse-shared-prefix-decode"),
        ({"shared_prefix_decode": "on", "kernels": "extend,compress"}, "--hierasparse-shared-prefix-decode"),
        ({"shared_prefix_decode": "extend", "kernels": "extend,compress"}, "--hierasparse-shared-prefix-decode"),
        ({"store_dtype": "fp8_e5m2", "kernels": "none"}, "--hierasparse-store-dtype"),
        ({"store_dtype": "fp8_e4m3"}, "--hierasparse-kernels"),  # the compress kernel writes 16-bit blocks
        ({"store_dtype": "fp8_e4m3", "kernels": "compress"}, "--hierasparse-kernels"),
        ({"store_dtype": "fp8_e4m3", "kernels": "decode,compress"}, "--hierasparse-kernels"),
    ],
)
def test_bad_setting_names_flag_and_allowed_values(values, flag):
    with pytest.raises(HieraSparseConfigError) as info:
        HieraSparseConfig.from_mapping(values)
    message = str(info.value)
    assert flag in message and "allowed:" in message and "\n" not in message


def test_shared_prefix_decode_values():
    for value in ("off", "on"):
        assert HieraSparseConfig.from_mapping({"shared_prefix_decode": value}).shared_prefix_decode == value
    with pytest.raises(HieraSparseConfigError, match="'off' or 'on'"):  # 'extend' became 'on' (4112877)
        HieraSparseConfig.from_mapping({"shared_prefix_decode": "extend"})


def test_store_dtype():
    import torch

    assert HieraSparseConfig().store_value_dtype is None
    config = HieraSparseConfig.from_mapping({"store_dtype": "fp8_e4m3", "kernels": "none"})
    assert config.store_value_dtype == torch.float8_e4m3fn
    # The decode and extend kernels take FP8 KV; the compressor is PyTorch's.
    for kernels in ("decode", "extend", "decode,extend", "extend,decode"):
        assert HieraSparseConfig.from_mapping({"store_dtype": "fp8_e4m3", "kernels": kernels}).fp8_kernels_only()
    with pytest.raises(HieraSparseConfigError, match=r"allowed: 'none' or a comma list from \['decode', 'extend'\] with"):
        HieraSparseConfig.from_mapping({"store_dtype": "fp8_e4m3", "kernels": "decode,extend,compress"})


def test_kernel_selection():
    assert all(HieraSparseConfig().uses_kernel(name) for name in ("decode", "extend", "compress"))
    config = HieraSparseConfig(kernels="decode,compress")
    assert config.uses_kernel("decode") and config.uses_kernel("compress") and not config.uses_kernel("extend")
    assert not any(HieraSparseConfig(kernels="none").uses_kernel(n) for n in ("decode", "extend", "compress"))


def test_model_and_gpu_checks():
    config = HieraSparseConfig()
    config.validate_model(head_dim=128, dtype="bfloat16", kv_cache_dtype="auto", gqa_group=4)
    with pytest.raises(HieraSparseConfigError, match="head_dim=96.*multiple of 16 with --hierasparse-kernels none"):
        config.validate_model(head_dim=96, dtype="float16", kv_cache_dtype="auto", gqa_group=4)
    for head_dim in (96, 256):  # Phi-3, Gemma-sized heads: the PyTorch paths
        HieraSparseConfig(kernels="none").validate_model(head_dim=head_dim, dtype="float16", kv_cache_dtype="auto",
                                                         gqa_group=4)  # fmt: skip
    with pytest.raises(HieraSparseConfigError, match="head_dim=72"):
        HieraSparseConfig(kernels="none").validate_model(head_dim=72, dtype="float16", kv_cache_dtype="auto", gqa_group=4)
    with pytest.raises(HieraSparseConfigError, match="--dtype='float32'"):
        config.validate_model(head_dim=64, dtype="float32", kv_cache_dtype="auto", gqa_group=4)
    with pytest.raises(HieraSparseConfigError, match="kv-cache-dtype.*'fp8_e4m3' with --hierasparse-store-dtype fp8_e4m3"):
        config.validate_model(head_dim=64, dtype="float16", kv_cache_dtype="fp8_e4m3", gqa_group=4)
    fp8_kernels = HieraSparseConfig(kernels="decode,extend", store_dtype="fp8_e4m3")
    fp8_kernels.validate_model(head_dim=64, dtype="float16", kv_cache_dtype="fp8_e4m3", gqa_group=4)
    with pytest.raises(HieraSparseConfigError, match="kv-cache-dtype"):  # FP8 pages beside a 16-bit store
        HieraSparseConfig(kernels="decode,extend").validate_model(head_dim=64, dtype="float16",
                                                                  kv_cache_dtype="fp8_e4m3", gqa_group=4)  # fmt: skip
    with pytest.raises(HieraSparseConfigError, match="kv-cache-dtype"):
        HieraSparseConfig(kernels="none").validate_model(head_dim=64, dtype="float16", kv_cache_dtype="fp8_e5m2",
                                                         gqa_group=4)  # fmt: skip
    HieraSparseConfig(kernels="none").validate_model(head_dim=64, dtype="float16", kv_cache_dtype="fp8_e4m3", gqa_group=4)
    # The decode and extend kernels take every group from 1 to 8 (SmolLM2 and Llama-3.2-3B: 3, Qwen3-14B: 5,
    # Qwen2.5-1.5B: 6, Qwen2.5-7B: 7); a larger group runs those paths in PyTorch or is refused.
    for group in range(1, 9):
        config.validate_model(head_dim=64, dtype="float16", kv_cache_dtype="auto", gqa_group=group)
    with pytest.raises(HieraSparseConfigError, match="--hierasparse-kernels='decode,extend,compress'.*12 query heads"):
        config.validate_model(head_dim=64, dtype="float16", kv_cache_dtype="auto", gqa_group=12)
    for kernels in ("compress", "none"):
        HieraSparseConfig(kernels=kernels).validate_model(head_dim=64, dtype="float16", kv_cache_dtype="auto",
                                                          gqa_group=12)  # fmt: skip
    HieraSparseConfig.validate_gpu((9, 0), "H100")
    with pytest.raises(HieraSparseConfigError, match="compute capability 8.9"):
        HieraSparseConfig.validate_gpu((8, 9), "L40S")
    with pytest.raises(HieraSparseConfigError, match="no CUDA GPU"):
        HieraSparseConfig.validate_gpu(None)


def test_env_roundtrip_and_bad_env(monkeypatch):
    config = HieraSparseConfig(sk_prefill=0.5, sv_prefill=1.0, window_tokens=128)
    monkeypatch.setenv(ENV_VAR, config.to_json())
    assert HieraSparseConfig.from_env() == config
    monkeypatch.setenv(ENV_VAR, json.dumps({"sk_prefill": "lots"}))
    with pytest.raises(HieraSparseConfigError, match="sk_prefill"):
        HieraSparseConfig.from_env()
    monkeypatch.setenv(ENV_VAR, json.dumps({"speed": 1}))
    with pytest.raises(HieraSparseConfigError, match="unknown setting"):
        HieraSparseConfig.from_env()


def test_launcher_prints_one_line_for_bad_flag(tmp_path):
    # The launcher must stop before touching a GPU, with no traceback.
    result = run_python(
        "-m", "sglang.launch_server", "--model-path", str(tmp_path),
        "--attention-backend", "hierasparse", "--hierasparse-sv-prefill", "1.5",
        cwd="/",
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "error: hierasparse: --hierasparse-sv-prefill=1.5 is invalid; allowed: a fraction in [0, 1]"


def test_launcher_checks_page_size_and_device(tmp_path):
    from sglang_hs.launch.make_model import LLAMA_31_8B, write_llama_config

    write_llama_config(str(tmp_path), LLAMA_31_8B)
    base = ["-m", "sglang.launch_server", "--model-path", str(tmp_path), "--attention-backend", "hierasparse",
            "--device", "cpu"]
    result = run_python(*base, "--page-size", "16", cwd="/")
    assert result.stderr.strip().splitlines()[-1] == (
        "error: hierasparse: --page-size=16 differs from --hierasparse-block-size=64; allowed: 64 or unset"
    )
    result = run_python(*base, cwd="/")
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: hierasparse: --device=cpu is invalid; allowed: cuda"


def test_launcher_refuses_decode_and_extend_kernels_for_an_unsupported_gqa_group(tmp_path):
    from sglang_hs.launch.make_model import LLAMA_31_8B, write_llama_config

    write_llama_config(str(tmp_path), LLAMA_31_8B)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(num_attention_heads=96, num_key_value_heads=8, hidden_size=12288, head_dim=128)  # group 12
    config_path.write_text(json.dumps(config))
    base = ["-m", "sglang.launch_server", "--model-path", str(tmp_path), "--attention-backend", "hierasparse",
            "--device", "cpu"]
    result = run_python(*base, cwd="/")
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: hierasparse: --hierasparse-kernels='decode,extend,compress' is invalid; allowed: 'compress' or "
        "'none' for this model: its 12 query heads per KV head are not a GQA group of the decode and extend "
        "kernels ([1, 2, 3, 4, 5, 6, 7, 8])"
    )
    # With the compressor alone the model passes the shape checks (and stops at the CPU device).
    result = run_python(*base, "--hierasparse-kernels", "compress", cwd="/")
    assert result.stderr.strip().splitlines()[-1] == "error: hierasparse: --device=cpu is invalid; allowed: cuda"


def test_launcher_takes_fp8_pages_beside_an_fp8_store(tmp_path):
    """--kv-cache-dtype fp8_e4m3: refused in one line with the default kernels (the compress kernel and a
    16-bit store), accepted with an FP8 store on the PyTorch paths or the decode and extend kernels (then
    the run stops at the CPU device, after every shape check)."""
    from sglang_hs.launch.make_model import LLAMA_31_8B, write_llama_config

    write_llama_config(str(tmp_path), LLAMA_31_8B)
    base = ["-m", "sglang.launch_server", "--model-path", str(tmp_path), "--attention-backend", "hierasparse",
            "--device", "cpu", "--kv-cache-dtype", "fp8_e4m3"]  # fmt: skip
    last = run_python(*base, cwd="/").stderr.strip().splitlines()[-1]
    assert last.startswith("error: hierasparse: --kv-cache-dtype='fp8_e4m3' is invalid; allowed:") and "store-dtype fp8_e4m3" in last
    for kernels in ("none", "decode,extend"):
        result = run_python(*base, "--hierasparse-kernels", kernels, "--hierasparse-store-dtype", "fp8_e4m3", cwd="/")
        assert result.stderr.strip().splitlines()[-1] == "error: hierasparse: --device=cpu is invalid; allowed: cuda"


def test_architectures_the_store_cannot_serve_are_refused_in_one_line():
    """MLA, sliding-window, chunked-local and encoder-decoder attention: one line each, naming the model."""
    HieraSparseConfig.validate_architecture("LlamaForCausalLM", "MHA")
    cases = [(dict(attention_arch="MLA"), "MLA attention"),
             (dict(attention_arch="MHA", sliding_window=True), "sliding-window attention"),
             (dict(attention_arch="MHA", chunked_attention=True), "chunked local attention"),
             (dict(attention_arch="MHA", encoder_decoder=True), "encoder-decoder attention")]
    for kwargs, why in cases:
        with pytest.raises(HieraSparseConfigError) as info:
            HieraSparseConfig.validate_architecture("SomeForCausalLM", **kwargs)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"hierasparse: --model-path is a SomeForCausalLM with {why}; ")


def _launch_with_config(tmp_path, **overrides):
    from sglang_hs.launch.make_model import LLAMA_31_8B, write_llama_config

    write_llama_config(str(tmp_path), LLAMA_31_8B)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **overrides}))
    return run_python("-m", "sglang.launch_server", "--model-path", str(tmp_path), "--attention-backend",
                      "hierasparse", "--device", "cpu", cwd="/")


def test_launcher_refuses_sliding_window_models_before_loading_weights(tmp_path):
    """A Mistral-style window on every layer is refused by the launcher; Qwen2's disabled window is not."""
    result = _launch_with_config(tmp_path, sliding_window=4096)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: hierasparse: --model-path is a LlamaForCausalLM with sliding-window attention; allowed: ")
    result = _launch_with_config(tmp_path, sliding_window=131072, use_sliding_window=False)
    assert result.stderr.strip().splitlines()[-1] == "error: hierasparse: --device=cpu is invalid; allowed: cuda"


@pytest.mark.parametrize("config_update,flags,message", [
    ({"head_dim": 96}, [], "error: hierasparse: the model's head_dim=96 is invalid; allowed: one of [64, 128], or a "
                           "multiple of 16 with --hierasparse-kernels none"),
    ({}, ["--dtype", "float32"], "error: hierasparse: --dtype='float32' is invalid; allowed: one of ['float16', 'bfloat16']"),
    ({}, ["--kv-cache-dtype", "fp8_e5m2"], "error: hierasparse: --kv-cache-dtype='fp8_e5m2' is invalid; allowed: 'auto' or "
                                           "the model dtype 'bfloat16', or 'fp8_e4m3' with --hierasparse-store-dtype "
                                           "fp8_e4m3 and --hierasparse-kernels 'none' or a comma list from "
                                           "['decode', 'extend']"),
    ({}, ["--hierasparse-store-dtype", "fp8_e4m3"], "error: hierasparse: --hierasparse-kernels='decode,extend,compress' "
                                                    "is invalid; allowed: 'none' or a comma list from ['decode', "
                                                    "'extend'] with --hierasparse-store-dtype=fp8_e4m3"),
], ids=["head_dim", "dtype", "kv_dtype", "fp8_store_with_compress_kernel"])
def test_launcher_refuses_what_the_kernels_cannot_take_in_one_line(tmp_path, config_update, flags, message):
    """Each shape, dtype and KV dtype the kernels cannot take stops the launcher, before any weights load,
    with one line naming the flag (or the model's value) and what is allowed."""
    from sglang_hs.launch.make_model import LLAMA_31_8B, write_llama_config

    write_llama_config(str(tmp_path), LLAMA_31_8B)
    if config_update:
        config_path = tmp_path / "config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config_update}))
    result = run_python("-m", "sglang.launch_server", "--model-path", str(tmp_path), "--attention-backend",
                        "hierasparse", "--device", "cpu", *flags, cwd="/")  # fmt: skip
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == message
