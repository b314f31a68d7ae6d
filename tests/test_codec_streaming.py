"""Exactness of the stateful streaming codec decoder against one-piece decode (tiny codec, CPU),
with weights re-scaled so the transformer, ConvNeXt and SnakeBeta paths all matter."""

from __future__ import annotations

import time

import pytest
import torch

from tts_server.codec import CodecState, StreamingCodecDecoder
from tts_server.codec.offline import decode_full

TOL = 1e-4
RESIDUAL_GAIN = 0.25


def _make_decoder(size: str = "tiny", seed: int = 0):
    """A codec decoder whose every path contributes: fan-in scaled weights, LayerScale 1,
    ConvNeXt gamma ~1, small random SnakeBeta alpha/beta, final conv scaled to RMS ~0.25."""
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as qm

    from tts_server.model.synthetic import codec_config, randomize_codebooks

    torch.manual_seed(seed)
    model = qm.Qwen3TTSTokenizerV2Model(codec_config(size)).eval()
    randomize_codebooks(model, torch.Generator().manual_seed(seed + 1))
    dec = model.decoder
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, mod in dec.named_modules():
            if name.startswith("quantizer"):
                continue
            if isinstance(mod, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
                w = mod.weight
                if isinstance(mod, torch.nn.ConvTranspose1d):  # [Cin, Cout, K]: Cin*K/s taps per output
                    fan_in = w.shape[0] * w.shape[2] // mod.stride[0]
                else:
                    fan_in = w[0].numel()
                w.copy_(torch.randn(w.shape, generator=gen) / fan_in**0.5)
                if mod.bias is not None:
                    mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=gen))
        for mod in dec.modules():
            if isinstance(mod, qm.Qwen3TTSTokenizerV2DecoderDecoderResidualUnit):
                mod.conv2.conv.weight.mul_(RESIDUAL_GAIN)  # keeps activations O(1) down the stack
            elif isinstance(mod, qm.Qwen3TTSTokenizerV2DecoderLayerScale):
                mod.scale.fill_(1.0)
            elif isinstance(mod, qm.Qwen3TTSTokenizerV2ConvNeXtBlock):
                mod.gamma.copy_(1.0 + 0.1 * torch.randn(mod.gamma.shape, generator=gen))
            elif isinstance(mod, qm.SnakeBeta):
                mod.alpha.copy_(0.3 * torch.randn(mod.alpha.shape, generator=gen))
                mod.beta.copy_(0.3 * torch.randn(mod.beta.shape, generator=gen))
        seen = []
        hook = dec.decoder[-1].register_forward_hook(lambda m, i, o: seen.append(o))
        decode_full(dec, torch.randint(0, 2048, (50, 16), generator=gen))
        hook.remove()
        dec.decoder[-1].conv.weight.mul_(0.25 / seen[0].std().item())  # pre-clamp RMS -> 0.25
        dec.decoder[-1].conv.bias.zero_()
    return dec


def _codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (n, 16), generator=torch.Generator().manual_seed(seed))  # [T, 16]


def _stream(sd: StreamingCodecDecoder, state: CodecState, codes: torch.Tensor, sizes) -> torch.Tensor:
    """Decode codes [T, 16] in chunks cycling through `sizes` -> audio [T * 1920]."""
    out, i, k = [], 0, 0
    while i < codes.shape[0]:
        n = sizes[k % len(sizes)]
        out.append(sd.decode(state, codes[i : i + n]))
        i, k = i + n, k + 1
    return torch.cat(out)


@pytest.fixture(scope="module")
def dec():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: avoids thread spin contention on a shared 2-core box
    yield _make_decoder()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def long_case(dec):
    codes = _codes(640, seed=10)
    return codes, decode_full(dec, codes)


def test_fixture_is_meaningful(dec, long_case):
    _, ref = long_case
    assert ref.shape == (640 * 1920,)
    assert 0.05 < ref.std().item() < 0.6
    assert (ref.abs() < 0.999).float().mean().item() > 0.95  # clamp rarely active


def test_frame_by_frame_matches_full(dec, long_case):
    codes, ref = long_case
    sd = StreamingCodecDecoder(dec)
    st = sd.new_state()
    state_bytes = st.nbytes
    t0 = time.perf_counter()
    out = _stream(sd, st, codes, [1])
    per_frame = (time.perf_counter() - t0) / codes.shape[0]
    err = (out - ref).abs().max().item()
    print(f"\nframe-by-frame: {codes.shape[0]} frames, max abs err {err:.3e}, "
          f"{per_frame * 1e3:.2f} ms/frame (tiny codec, CPU, 1 thread), state {st.nbytes} B")
    assert st.num_frames == codes.shape[0] and st.nbytes == state_bytes  # fixed-size state
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert err < TOL


def test_chunk_ramp_matches_full(dec, long_case):
    codes, ref = long_case
    sd = StreamingCodecDecoder(dec)
    out = _stream(sd, sd.new_state(), codes, [1, 2, 3, 4, 7, 8, 16, 32, 64, 100, 1, 5, 128, 2])
    err = (out - ref).abs().max().item()
    print(f"\nchunk ramp: max abs err {err:.3e}")
    assert err < TOL


def test_failure_is_detectable(dec, long_case):
    codes, ref = long_case
    with torch.inference_mode():
        official = dec.chunked_decode(codes.t()[None], chunk_size=300, left_context_size=25).reshape(-1)
    err_official = (official - ref).abs().max().item()
    sd = StreamingCodecDecoder(dec)
    st = sd.new_state()
    head = sd.decode(st, codes[:200])
    gen = torch.Generator().manual_seed(3)
    st.kv = [(k + 0.5 * torch.randn(k.shape, generator=gen), v) for k, v in st.kv]  # corrupt keys
    bad = torch.cat([head, sd.decode(st, codes[200:260])])
    err_kv = (bad - ref[: 260 * 1920]).abs().max().item()
    print(f"\nofficial chunked_decode(300, ctx 25): max err {err_official:.3e}; corrupted K: {err_kv:.3e}")
    assert err_official > 100 * TOL
    assert err_kv > 100 * TOL


def test_priming_with_reference_codes(dec):
    ref_codes, new_codes = _codes(150, seed=20), _codes(180, seed=21)
    full = decode_full(dec, torch.cat([ref_codes, new_codes]))
    sd = StreamingCodecDecoder(dec)
    st = sd.new_state()
    sd.decode(st, ref_codes)  # prime in one piece; audio discarded
    out = _stream(sd, st, new_codes, [1, 3, 8, 2])
    err = (out - full[150 * 1920 :]).abs().max().item()
    print(f"\npriming: max abs err {err:.3e}")
    assert st.num_frames == 330
    assert err < TOL


def test_independent_states_do_not_interfere(dec):
    a, b = _codes(200, seed=30), _codes(200, seed=31)
    ref_a, ref_b = decode_full(dec, a), decode_full(dec, b)
    sd = StreamingCodecDecoder(dec)
    sa, sb = sd.new_state(), sd.new_state()
    out_a, out_b, i = [], [], 0
    for n in [1, 4, 2, 9, 1, 16, 3] * 8:
        if i >= 200:
            break
        out_a.append(sd.decode(sa, a[i : i + n]))
        out_b.append(sd.decode(sb, b[i : i + n]))
        i += n
    err_a = (torch.cat(out_a) - ref_a).abs().max().item()
    err_b = (torch.cat(out_b) - ref_b).abs().max().item()
    print(f"\ninterleaved: max abs err {err_a:.3e} / {err_b:.3e}")
    assert err_a < TOL and err_b < TOL
    assert (ref_a - ref_b).abs().max().item() > 0.1


def test_bad_codes_shape_rejected(dec):
    sd = StreamingCodecDecoder(dec)
    with pytest.raises(ValueError):
        sd.decode(sd.new_state(), torch.zeros(16, dtype=torch.long))
