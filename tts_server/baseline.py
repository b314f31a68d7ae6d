"""Same-run baseline for `tts-bench`: the unmodified qwen-tts `generate_custom_voice` path, in-process
and non-streaming (its first audio is the whole utterance), one JSON record per request.

    python -m tts_server.baseline --model synthetic-tiny --requests reqs.jsonl --json-lines
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

FRAME_RATE = 12.5  # codec frames per second of audio
WARMUP_FRAMES = 8  # a warm-up request runs every code path; more frames add nothing


def read_requests(path: str) -> list[dict]:
    """JSON lines with index, text, language, voice, seed, max_frames ('-' reads stdin)."""
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    with f:
        return [json.loads(line) for line in f if line.strip()]


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run_batch(loaded, batch: list[dict], voice: str) -> tuple[list, int, float]:
    """One `generate_custom_voice` call for `batch` -> (waveforms, sample rate, wall seconds)."""
    import torch

    torch.manual_seed(batch[0]["seed"])
    # qwen-tts keeps max_new_tokens - 1 frames (the last step's code predictor output is dropped),
    # so one more token gives the same frame cap as the server's max_frames.
    max_new_tokens = max(r["max_frames"] for r in batch) + 1
    _synchronize(loaded.device)
    t0 = time.perf_counter()
    wavs, rate = loaded.tts.generate_custom_voice(
        [r["text"] for r in batch], speaker=[r.get("voice") or voice for r in batch],
        language=[r.get("language") or "auto" for r in batch], max_new_tokens=max_new_tokens)
    _synchronize(loaded.device)
    return wavs, rate, time.perf_counter() - t0


def run(loaded, requests: list[dict], batch_size: int, voice: str, emit) -> None:
    """Runs `requests` in static batches of `batch_size` (1 = one at a time) and emits a record
    per request; every request of a batch gets its first audio when the whole batch ends."""
    t_start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        start_s = time.perf_counter() - t_start
        try:
            wavs, rate, wall_s = run_batch(loaded, batch, voice)
            error = ""
        except Exception as e:  # noqa: BLE001 - reported per request, the run goes on
            wavs, rate, error = [None] * len(batch), 24000, repr(e)
            wall_s = time.perf_counter() - t_start - start_s
        for r, wav in zip(batch, wavs):
            num_samples = 0 if wav is None else len(wav)
            num_frames = round(num_samples * FRAME_RATE / rate)
            emit(dict(index=r["index"], concurrency=batch_size, status="ERROR" if error else "OK",
                      error=error, start_s=start_s, end_s=start_s + wall_s, wall_ms=wall_s * 1000,
                      ttfc_ms=None if error else wall_s * 1000, audio_s=num_samples / rate,
                      num_frames=num_frames,
                      finish_reason="" if error else
                      ("eos" if num_frames < r["max_frames"] else "max_length")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tts_server.baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="synthetic-tiny | synthetic | a snapshot | hub id")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--voice", default="", help="speaker for requests naming none (default: the first)")
    p.add_argument("--requests", required=True, help="JSON-lines request file, '-' for stdin")
    p.add_argument("--batch-sizes", default="1", help="comma-separated static batch sizes")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first (at most 8 frames each)")
    p.add_argument("--json-lines", action="store_true", help="one JSON record per line on stdout")
    a = p.parse_args(argv)
    # Library prints (qwen-tts, transformers) go to stderr so stdout carries only records.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(rec: dict) -> None:
        if a.json_lines:
            out.write(json.dumps(rec) + "\n")
        else:
            out.write(f"c={rec['concurrency']} #{rec['index']} {rec['status']} wall {rec['wall_ms']:.0f} ms "
                      f"audio {rec['audio_s']:.2f} s {rec['finish_reason']} {rec['error']}\n")

    from .model.loader import load_model

    requests = read_requests(a.requests)
    loaded = load_model(a.model, a.device, a.dtype)
    if loaded.model_type != "custom_voice":
        raise SystemExit(f"baseline: {a.model} is a {loaded.model_type} model; only CustomVoice "
                         "models are supported")
    voice = a.voice or loaded.speakers[0]
    for r in requests[:a.warmup]:
        run_batch(loaded, [dict(r, max_frames=min(r["max_frames"], WARMUP_FRAMES))], voice)
    for size in (int(x) for x in a.batch_sizes.split(",") if x):
        run(loaded, requests, size, voice, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
