"""The shared pytest plugin's markers: each test carries its distribution's, which is how
``nox -s tests`` picks ucm-core's every-Python tests out of one run."""

from pathlib import Path

from ucm.lab.pytest_plugin import distribution_marker


def test_a_test_is_marked_with_the_distribution_whose_tests_folder_holds_it(request):
    assert request.node.get_closest_marker("ucm_lab") is not None
    assert request.node.get_closest_marker("ucm_core") is None
    assert distribution_marker(Path("/r/packages/ucm-core/tests/test_x.py")) == "ucm_core"
    assert distribution_marker(Path("/r/packages/ucm-vllm/tests/sub/test_y.py")) == "ucm_vllm"
    # a checkout under a folder named like a distribution is still its own tests' folder
    assert (
        distribution_marker(
            Path("/packages/ucm-core/tests/w/packages/ucm-fastdeploy/tests/test_z.py")
        )
        == "ucm_fastdeploy"
    )
    assert distribution_marker(Path("/r/packages/ucm-core/src/ucm/core/x.py")) is None
    assert distribution_marker(Path("/usr/lib/python3/dist-packages/p/tests/test_q.py")) is None
