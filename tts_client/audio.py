"""Audio payload helpers: chunk bytes <-> numpy, WAV writing (soundfile)."""

from __future__ import annotations

import numpy as np

from .pb.tts.v1 import tts_pb2


G711 = {tts_pb2.AUDIO_ENCODING_MULAW: "ULAW", tts_pb2.AUDIO_ENCODING_ALAW: "ALAW"}


def chunk_samples(chunk: tts_pb2.AudioChunk) -> np.ndarray:
    """An AudioChunk's audio as float32 samples in [-1, 1] (G.711 decoded by libsndfile). Ogg
    Opus chunks are pieces of one file: join their bytes and decode the whole."""
    if chunk.encoding == tts_pb2.AUDIO_ENCODING_FLOAT32_LE:
        return np.frombuffer(chunk.audio, dtype="<f4").astype(np.float32)
    if chunk.encoding in G711:
        import io

        import soundfile

        return soundfile.read(io.BytesIO(chunk.audio), dtype="float32", format="RAW",
                              subtype=G711[chunk.encoding], samplerate=chunk.sample_rate_hz,
                              channels=1)[0]
    if chunk.encoding == tts_pb2.AUDIO_ENCODING_OGG_OPUS:
        raise ValueError("an Ogg Opus chunk is part of one file: join the chunks' bytes and "
                         "decode them together")
    return np.frombuffer(chunk.audio, dtype="<i2").astype(np.float32) / 32768.0


def write_wav(path: str, samples: np.ndarray, sample_rate: int) -> None:
    """Write mono float32 samples as a 16-bit PCM WAV file."""
    import soundfile

    soundfile.write(path, samples, sample_rate, subtype="PCM_16", format="WAV")
