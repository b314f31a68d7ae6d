"""Benchmark workloads: built-in sentences (ten languages, short replies to paragraphs), text files,
and a seeded request schedule whose per-request audio caps are explicit and shared with the baseline."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Utterance:
    text_id: str
    language: str  # a model language name ("english", ...) or "auto"
    text: str


BUILTIN: tuple[Utterance, ...] = (
    Utterance("en-short", "english", "Sure, I can help with that."),
    Utterance("en-reply", "english", "Your order has shipped and should arrive on Thursday."),
    Utterance("en-medium", "english",
              "The train to Edinburgh leaves from platform four at half past nine, so there is still "
              "time for a coffee before boarding."),
    Utterance("en-paragraph", "english",
              "Thanks for calling the support line. I have looked at your account, and the charge you "
              "mentioned comes from the annual renewal that was scheduled last week. If you would like, "
              "I can cancel the renewal and refund the full amount today; the money usually appears on "
              "your card within three to five business days. Is there anything else I can help with "
              "while we are on the phone?"),
    Utterance("zh-short", "chinese", "好的，我马上帮您查询。"),
    Utterance("zh-medium", "chinese", "明天上午北京晴转多云，最高气温二十三度，出门记得带上一件薄外套。"),
    Utterance("zh-paragraph", "chinese",
              "感谢您的耐心等待。我们已经核实了您的订单信息，包裹目前在上海的转运中心，预计后天下午送达。"
              "如果您希望修改收货地址或者预约送货时间，可以直接回复这条消息，我们的客服会在十分钟之内与您联系。"),
    Utterance("de-medium", "german",
              "Vielen Dank für Ihren Anruf. Ihr Termin wurde auf Donnerstag um vierzehn Uhr verschoben."),
    Utterance("es-short", "spanish", "¡Claro que sí! Enseguida te lo envío."),
    Utterance("es-paragraph", "spanish",
              "Buenas tardes. Le confirmo que la reserva para cuatro personas está hecha para el sábado a "
              "las nueve de la noche. La mesa estará en la terraza, tal como pidió, y si cambian sus planes "
              "puede cancelarla sin coste hasta el viernes al mediodía."),
    Utterance("fr-medium", "french",
              "Le musée ferme ses portes à dix-huit heures, mais la billetterie s'arrête trente minutes "
              "plus tôt."),
    Utterance("ja-short", "japanese", "少々お待ちください。"),
    Utterance("ja-medium", "japanese",
              "本日の会議は午後三時から始まります。資料は共有フォルダにアップロードしておきました。"),
    Utterance("ko-short", "korean", "네, 알겠습니다. 바로 확인해 드릴게요."),
    Utterance("ru-medium", "russian",
              "Пожалуйста, проверьте адрес доставки и подтвердите заказ до конца дня."),
    Utterance("it-short", "italian", "Grazie mille, a presto!"),
    Utterance("pt-medium", "portuguese",
              "O voo foi remarcado para amanhã de manhã, e o novo cartão de embarque já está no seu e-mail."),
)


# English voice-agent replies of realistic length spread (5 to 40 words), for load tests.
ENGLISH: tuple[Utterance, ...] = tuple(Utterance(f"en{i:02d}", "english", t) for i, t in enumerate((
    "Sure, I can do that.",
    "Your table is booked for seven.",
    "Let me check that for you right now.",
    "The package left our warehouse this morning and is on its way.",
    "I found three flights that leave before noon on Friday.",
    "Could you spell your last name for me, please?",
    "Your current balance is two hundred and forty dollars and fifteen cents.",
    "I am sorry, but that store closes at six on Sundays.",
    "The meeting has been moved to Tuesday at half past ten, in the large conference room on the "
    "third floor.",
    "To reset your password, open the settings page, choose security, and follow the link we send "
    "to your email address.",
    "Good news: the repair is covered by your warranty, so there is nothing to pay.",
    "It will be sunny in the afternoon with a high of twenty four degrees and a light breeze from "
    "the west.",
    "I have added two large pizzas, a garden salad and a bottle of sparkling water to your order.",
    "Before we continue, I need to confirm your identity with the last four digits of your card.",
    "The train is running about ten minutes late because of maintenance work near the station, and "
    "it should arrive at platform two.",
    "Thanks for waiting. I spoke with the billing team, and they agreed to remove the late fee from "
    "this month's statement, so your new total is one hundred and twelve dollars.",
    "If you would like, I can send you a text message with the address, the opening hours and a "
    "link to the map so you have everything in one place.",
    "Your appointment with Doctor Patel is confirmed for Monday morning at nine fifteen; please "
    "arrive ten minutes early and bring your insurance card and a list of your current medications.",
    "I understand how frustrating that must be, and I am going to stay on the line with you while "
    "we sort it out together, starting with the error message you saw and the exact time the "
    "payment failed this morning.",
    "Is there anything else I can help you with today?",
    "The return window is thirty days from delivery, and the label is free if you print it from "
    "your account page.",
    "We received your application on the fourth, it is under review, and you should hear back from "
    "the admissions office within two weeks.",
    "Great, I have updated your delivery address.",
    "The quickest route takes about twenty five minutes right now because of heavy traffic on the "
    "main bridge, so I would suggest leaving a little earlier than planned.",
)))
WORKLOADS = {"builtin": BUILTIN, "english": ENGLISH}


@dataclass(frozen=True)
class BenchRequest:
    """One scheduled request; identical for the gRPC server and the baseline."""

    index: int
    utterance: Utterance
    seed: int
    max_frames: int  # audio cap in 80 ms codec frames, sent as max_duration_s = max_frames / 12.5

    def max_duration_s(self, frame_rate: float = 12.5) -> float:
        return self.max_frames / frame_rate


def load_text_file(path: str) -> list[Utterance]:
    """One utterance per non-empty line: `TEXT`, or `LANGUAGE<TAB>TEXT`; '#' starts a comment line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            lang, _, text = line.partition("\t") if "\t" in line else ("auto", "", line)
            out.append(Utterance(f"line{num}", lang.strip().lower() or "auto", text.strip()))
    if not out:
        raise ValueError(f"{path}: no text lines")
    return out


def spoken_seconds(text: str) -> float:
    """Rough natural speaking time: 0.25 s per CJK/kana/hangul character, 0.07 s per other
    character (about 15 characters per second), plus 0.3 s."""
    wide = sum(1 for ch in text if ord(ch) >= 0x2E80)
    return 0.3 + 0.25 * wide + 0.07 * (len(text) - wide)


def schedule(utterances, num_requests: int, seed: int, max_duration_s: float,
             frame_rate: float = 12.5, fixed: bool = False) -> list[BenchRequest]:
    """`num_requests` requests cycling through a seeded shuffle of `utterances`; request i samples
    with seed `seed + i` and is capped at min(its spoken length, `max_duration_s`) in whole frames,
    or at exactly `max_duration_s` when `fixed` (load tests of streams of a set length)."""
    order = list(utterances)
    random.Random(seed).shuffle(order)
    cap = max(1, math.floor(max_duration_s * frame_rate + 1e-6))
    out = []
    for i in range(num_requests):
        u = order[i % len(order)]
        frames = cap if fixed else min(cap, max(1, math.ceil(spoken_seconds(u.text) * frame_rate)))
        out.append(BenchRequest(i, u, seed + i, frames))
    return out


def poisson_arrivals(num: int, rps: float, seed: int) -> list[float]:
    """Seconds from the start at which `num` requests arrive as a Poisson process of `rps` per
    second (seeded by rate: gRPC and HTTP runs at one rate get the same schedule)."""
    rng = random.Random(seed + int(rps * 1000))
    arrivals, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(rps)
        arrivals.append(t)
    return arrivals


async def open_loop(items, arrivals: list[float], run, progress=None) -> list:
    """Starts `run(i, item, t_start)` for item i at t_start + arrivals[i] whatever is still in
    flight -> the records (each with .index and .status), in request order."""
    t_start, tasks = time.perf_counter(), []

    async def one(i, item):
        rec = await run(i, item, t_start)
        if progress:
            progress.update(rec.status == "OK")
        return rec

    for i, item in enumerate(items):
        delay = t_start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, item)))
    return sorted(await asyncio.gather(*tasks), key=lambda r: r.index)
