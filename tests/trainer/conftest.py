import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run as fast on one thread, and two threads crawl when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
