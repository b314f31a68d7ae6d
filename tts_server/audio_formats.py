"""Output audio formats: streaming encoders from float32 samples to pcm, wav, mp3, opus, flac,
aac, mu-law and A-law bytes (FFmpeg's encoders and muxers through PyAV; no torch).

One `AudioEncoder` per stream: `encode(samples)` returns the bytes that are ready (a container's
header goes out with the first audio), `finish()` flushes the encoder and the muxer."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass

import numpy as np

MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


@dataclass(frozen=True)
class AudioFormat:
    name: str  # the OpenAI `response_format` value
    content_type: str
    container: str | None  # FFmpeg muxer; None: raw 16-bit little-endian PCM
    codec: str | None
    rates: tuple[int, ...] | None = None  # sample rates the codec takes (None: any)
    default_rate: int | None = None  # None: the model's native rate
    muxer_options: tuple[tuple[str, str], ...] = ()
    block_s: float | None = None  # encoder frame length (FLAC's block); None: the codec's own
    is_s16: bool = False  # the codec takes 16-bit samples: quantized as `pcm` is, same values


FORMATS = {f.name: f for f in (
    AudioFormat("pcm", "audio/pcm", None, None),
    AudioFormat("wav", "audio/wav", "wav", "pcm_s16le", muxer_options=(("fflags", "+bitexact"),),
                is_s16=True),
    # no ID3 tag and no Xing header: neither can be filled in on a stream
    AudioFormat("mp3", "audio/mpeg", "mp3", "libmp3lame", MP3_RATES,
                muxer_options=(("id3v2_version", "0"), ("write_xing", "0"))),
    # one Ogg page per 20 ms Opus packet (the default page holds a second of audio); Opus
    # decoders play at 48 kHz whatever rate went in. Bit-exact: the Ogg stream's serial number is
    # the encoder's `serial` (the stream's seed), not a random one, and the tags carry no
    # library version, so the same request and seed give the same bytes as PCM does
    AudioFormat("opus", "audio/ogg; codecs=opus", "ogg", "libopus", OPUS_RATES, 48000,
                muxer_options=(("page_duration", "20000"), ("fflags", "+bitexact"))),
    AudioFormat("flac", "audio/flac", "flac", "flac", block_s=0.02, is_s16=True),
    AudioFormat("aac", "audio/aac", "adts", "aac", AAC_RATES),
    AudioFormat("mulaw", "audio/basic", "mulaw", "pcm_mulaw", default_rate=8000, is_s16=True),
    AudioFormat("alaw", "audio/x-alaw-basic", "alaw", "pcm_alaw", default_rate=8000, is_s16=True),
)}


def s16(samples: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 (as the gRPC API's PCM_S16LE)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")


class _Sink:
    """A non-seekable file for PyAV's muxer: collects what it writes until taken."""

    def __init__(self):
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self._buf)
        self._buf.clear()
        return data


class AudioEncoder:
    """Streams one utterance in `fmt` at `sample_rate`. With `whole=True` the output goes to a
    seekable buffer instead and `finish()` returns the complete file (WAV and FLAC headers then
    carry the real length). `serial`: an Ogg stream's serial number (its low 31 bits; callers pass
    the stream's seed, so that a repeated request gives the same bytes and different ones
    different serials, as chained Ogg streams need). Thread-safe: a call may run in a worker
    thread while the stream's handler, cancelled, closes the encoder (close waits for it)."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, whole: bool = False, serial: int = 0):
        self.format, self.sample_rate, self.whole = fmt, sample_rate, whole
        self._lock = threading.Lock()
        self._closed = False
        self._pcm = bytearray() if fmt.container is None and whole else None
        if fmt.container is None:
            return
        import av  # PyAV: FFmpeg's encoders and muxers

        self._sink = io.BytesIO() if whole else _Sink()
        options = dict(fmt.muxer_options)
        if fmt.container == "ogg":
            options["serial_offset"] = str(serial & 0x7FFFFFFF)  # FFmpeg's option is a C int
        if not whole:
            options["flush_packets"] = "1"  # hand every packet to the sink at once
        self._out = av.open(self._sink, "w", format=fmt.container, options=options)
        codec_options = {}
        if fmt.block_s:
            codec_options["frame_size"] = str(max(16, int(sample_rate * fmt.block_s)))
        self._stream = self._out.add_stream(fmt.codec, rate=sample_rate, options=codec_options)
        self._stream.layout = "mono"
        self._av = av

    def encode(self, samples: np.ndarray) -> bytes:
        """samples [n] float32 in [-1, 1] -> the bytes ready to send (may be empty)."""
        if self.format.container is None:
            data = s16(samples).tobytes()
            if self._pcm is not None:
                self._pcm += data
                return b""
            return data
        with self._lock:
            if self._closed:
                return b""
            return self._encode(samples)

    def _encode(self, samples: np.ndarray) -> bytes:
        if self.format.is_s16:
            frame = self._av.AudioFrame.from_ndarray(s16(samples)[None, :], format="s16",
                                                     layout="mono")
        else:
            frame = self._av.AudioFrame.from_ndarray(
                np.ascontiguousarray(samples, dtype=np.float32)[None, :], format="flt",
                layout="mono")
        frame.sample_rate = self.sample_rate
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
        return b"" if self.whole else self._sink.take()

    def finish(self) -> bytes:
        """Flush the encoder; the remaining bytes (with `whole`: the whole file)."""
        if self.format.container is None:
            return bytes(self._pcm) if self._pcm is not None else b""
        with self._lock:
            if self._closed:
                return b""
            self._closed = True
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._out.close()
            return self._sink.getvalue() if self.whole else self._sink.take()

    def close(self) -> None:
        """Release FFmpeg's state without producing output (a stream that ended early)."""
        if self.format.container is None:
            return
        with self._lock:
            if not self._closed:
                self._closed = True
                self._out.close()
