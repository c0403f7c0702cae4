"""TensorBoard summaries: augmented-view grids, metric averaging, the PCA embedding picture."""

import numpy as np

from jssl.training import summaries


def test_pca_2d_finds_the_spread_directions():
    rs = np.random.RandomState(0)
    x = np.zeros((200, 5))
    x[:, 3] = rs.normal(size=200) * 10  # largest variance
    x[:, 1] = rs.normal(size=200) * 3  # second largest
    x[:, [0, 2, 4]] = rs.normal(size=(200, 3)) * 0.01
    p = summaries.pca_2d(x)
    np.testing.assert_allclose(np.abs(np.corrcoef(p[:, 0], x[:, 3])[0, 1]), 1, atol=1e-4)
    np.testing.assert_allclose(np.abs(np.corrcoef(p[:, 1], x[:, 1])[0, 1]), 1, atol=1e-2)


def test_embedding_picture_colours_by_class():
    rs = np.random.RandomState(0)
    labels = np.repeat(np.arange(3), 50)
    x = rs.normal(size=(150, 8)) * 0.1 + np.eye(8)[labels] * 5
    image = summaries.embedding_picture(x, labels, size=64)
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8
    colours = {tuple(c) for c in image.reshape(-1, 3)}
    for k in range(3):
        assert tuple(summaries._PALETTE[k]) in colours


def test_view_grid_denormalises():
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    views = [np.zeros((3, 4, 4, 3), np.float32), np.ones((3, 4, 4, 3), np.float32)]
    grid = summaries.view_grid(views, mean, std, max_examples=2)
    assert grid.shape == (8, 8, 3)
    np.testing.assert_allclose(grid[:, :4], 0.5)
    np.testing.assert_allclose(grid[:, 4:], 0.75)


def test_mean_metrics():
    out = summaries.mean_metrics([{"loss": np.float32(1.0)}, {"loss": np.float32(3.0)}])
    assert out == {"loss": 2.0}
