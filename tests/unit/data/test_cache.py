"""The keys of the prepared-data caches, without Ray: what each one covers, and that it hashes typed values."""

from __future__ import annotations


def test_tokenized_key_covers_what_shapes_tokens_and_nothing_else():
    from raypack.config import load
    from raypack.data.cache import packed_key, tokenized_key

    base = load(None, ["pack.budget=512"])
    same = ["pack.strategy=pad", "pack.batch_size=2.5", "pack.seed=3", "data.eval_fraction=0.2",
            "data.cache_path=/elsewhere", "tokenize.num_actors=4", "tokenize.batch_size=8", "train.grad_accum=4"]
    for override in same:
        assert tokenized_key(load(None, ["pack.budget=512", override])) == tokenized_key(base), override
    # The effective max_length is tokenize.max_length, else the budget: a budget change re-tokenizes
    # unless max_length is set.
    assert tokenized_key(load(None, ["pack.budget=256"])) != tokenized_key(base)
    assert tokenized_key(load(None, ["pack.budget=256", "tokenize.max_length=256"])) == tokenized_key(
        load(None, ["pack.budget=512", "tokenize.max_length=256"]))
    for override in ("tokenize.overlength=split", "tokenize.label_mask=all", "data.on_bad_rows=skip", "data.paths=[x.jsonl]"):
        assert tokenized_key(load(None, ["pack.budget=512", override])) != tokenized_key(base), override
    # The packed key covers the pack config, the eval split, ranks and accumulation on top.
    for override in same[:5] + ["train.grad_accum=4"]:
        if override.startswith(("data.cache_path", "tokenize.")):
            assert packed_key(load(None, ["pack.budget=512", override]), 2) == packed_key(base, 2), override
        else:
            assert packed_key(load(None, ["pack.budget=512", override]), 2) != packed_key(base, 2), override
    assert packed_key(base, 2) != packed_key(base, 4)
    # The eval cap shapes the split: the packed key's, never the tokenized key's.
    capped = load(None, ["pack.budget=512", "data.eval_max_examples=100"])
    assert tokenized_key(capped) == tokenized_key(base) and packed_key(capped, 2) != packed_key(base, 2)


def test_packed_root_is_the_cache_when_set():
    from raypack.config import load
    from raypack.data.cache import packed_key, packed_root

    assert packed_root(load(None, []), 2, "/runs/a") == "/runs/a/packed"
    cfg = load(None, ["data.cache_path=/shared/cache"])
    assert packed_root(cfg, 2, "/runs/a") == f"/shared/cache/packed/{packed_key(cfg, 2)}"


def test_keys_hash_typed_values_not_their_text():
    """A saved config reloads with a float written `8` as 8.0: the keys must not change with it."""
    from raypack.config import dumps, load, loads
    from raypack.data.cache import packed_key, tokenized_key

    for cfg in (load(), load(None, ["pack.batch_size=8", "tune.lrs=[1]"]), load(None, ["pack.batch_size=8.0"])):
        again = loads(dumps(cfg))
        assert tokenized_key(again) == tokenized_key(cfg) and packed_key(again, 2) == packed_key(cfg, 2)
    assert packed_key(load(None, ["pack.batch_size=8"]), 2) == packed_key(load(), 2)  # 8 is the default 8.0


def test_the_image_pixel_limit_keys_the_data_only_when_it_is_not_the_default():
    """data.max_image_pixels decides which image rows are bad: another limit is other data; the
    default keys as configs did before the field existed (their runs' packed data stands)."""
    from raypack.config import load
    from raypack.data.cache import tokenized_key

    assert tokenized_key(load(None, ["data.max_image_pixels=178956970"])) == tokenized_key(load(None))
    assert tokenized_key(load(None, ["data.max_image_pixels=1000"])) != tokenized_key(load(None))
    assert tokenized_key(load(None, ["data.max_image_pixels=null"])) != tokenized_key(load(None))


def test_a_mixtures_weights_shape_the_packed_key_and_its_sources_the_tokenized_key():
    """A changed weight, name or epoch size draws other examples from the same tokens: the same
    tokenized entry, another packed one (a different run); a source's paths, format or column
    names shape the tokens themselves."""
    from raypack.config import load
    from raypack.data.cache import packed_key, tokenized_key

    def mix(second: str = '{paths: [b.jsonl], weight: 1}', *more: str):
        return load(None, [f"data.sources=[{{paths: [a.jsonl], weight: 2}}, {second}]", *more])

    base = mix()
    for other in (mix('{paths: [b.jsonl], weight: 1.5}'), mix('{paths: [b.jsonl], weight: 1, name: bee}'),
                  mix('{paths: [b.jsonl], weight: 1}', "data.examples_per_epoch=all_exhausted")):
        assert tokenized_key(other) == tokenized_key(base) and packed_key(other, 2) != packed_key(base, 2)
    for other in (mix('{paths: [c.jsonl], weight: 1}'), mix('{paths: [b.jsonl], weight: 1, format: completion}'),
                  mix('{paths: [b.jsonl], weight: 1, columns: {prompt: q}}')):
        assert tokenized_key(other) != tokenized_key(base)
