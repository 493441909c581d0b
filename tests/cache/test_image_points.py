"""Where a prompt keeps prefix images (cache/prefix.image_points): grid boundaries only, never position 0."""

from nextserve.cache.prefix import image_points


def test_last_boundaries_checkpoints_and_anchors() -> None:
    # chunk 8: the prompt's last boundary (24) and the last one strictly inside it (the same prompt
    # again must recompute its last token), each checkpoint's boundary at or before it, every 2 chunks
    assert image_points(24, (), 8, 0) == {16, 24}
    assert image_points(27, (), 8, 0) == {24}
    assert image_points(27, (13, 40), 8, 0) == {8, 24}  # a checkpoint past the prompt is its end
    assert image_points(40, (), 8, 2) == {16, 32, 40}
    assert image_points(5, (3,), 8, 1) == frozenset()  # nothing before the first boundary
