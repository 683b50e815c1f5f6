"""Every transport declares its options; anything else is a ``ConfigError`` that names it
and lists the valid ones, on both sides, the in-memory fake included."""

from __future__ import annotations

import pytest
import torch

import streamsync as ss
from streamsync.transports import open_receiver, open_sender, schemes
from streamsync.transports.options import Option, resolve

TARGETS = {
    "memory": "memory://opts",
    "shm": "shm://opts",
    "zmq+tcp": "zmq+tcp://127.0.0.1:5555",
    "zmq+ipc": "zmq+ipc://opts",
    "cuda-ipc": "cuda-ipc://opts",
    "torch+gloo": "torch+gloo://127.0.0.1:5555",
    "torch+nccl": "torch+nccl://127.0.0.1:5555",
}


def test_every_builtin_scheme_is_covered() -> None:
    assert set(TARGETS) <= set(schemes())


@pytest.mark.parametrize("scheme", sorted(TARGETS))
def test_a_misspelt_url_option_names_the_valid_ones(scheme: str) -> None:
    url = TARGETS[scheme]
    with pytest.raises(
        ss.ConfigError, match=r"unknown URL option 'slot' \(did you mean 'slots'"
    ) as e:
        open_sender(f"{url}?slot=4")
    assert "receivers, slots, slot_bytes" in str(e.value)
    with pytest.raises(ss.ConfigError, match=r"unknown URL option 'recievers'.*'receivers'"):
        open_sender(f"{url}?recievers=2")
    with pytest.raises(ss.ConfigError, match=r"unknown URL option 'recievers'"):
        open_receiver(f"{url}?recievers=2")


@pytest.mark.parametrize("scheme", sorted(TARGETS))
def test_a_misspelt_keyword_names_the_valid_ones(scheme: str) -> None:
    url = TARGETS[scheme]
    with pytest.raises(ss.ConfigError, match=r"unknown option 'bogus'; valid: .*connect_timeout"):
        open_sender(url, bogus=1)
    with pytest.raises(ss.ConfigError, match=r"unknown option 'conect_timeout' \(did you mean"):
        open_receiver(url, conect_timeout=1)


@pytest.mark.parametrize("scheme", sorted(TARGETS))
def test_bad_values_are_config_errors(scheme: str) -> None:
    url = TARGETS[scheme]
    with pytest.raises(ss.ConfigError, match=r"slots=0; need at least 1"):
        open_sender(f"{url}?slots=0")
    with pytest.raises(ss.ConfigError, match=r"slot_bytes=10; need at least 1024"):
        open_sender(url, slot_bytes=10)
    with pytest.raises(ss.ConfigError, match=r"receivers='two' is not an integer"):
        open_sender(f"{url}?receivers=two")
    with pytest.raises(ss.ConfigError, match=r"'secret' cannot be given in the URL"):
        open_sender(f"{url}?secret=x")
    with pytest.raises(ss.ConfigError, match=r"secret=3: use a str or bytes"):
        open_receiver(url, secret=3)


def test_a_receiver_takes_the_senders_url() -> None:
    # The same URL serves both sides: sender options in it mean nothing to a receiver.
    open_receiver("shm://opts?receivers=2&slots=3")


def test_url_options_and_keywords_merge_keywords_winning() -> None:
    declared = (Option("slots", int, 2, "slots", minimum=1), Option("flag", bool, True, "f"))
    got = resolve("x://y", declared, {"slots": "3", "flag": "off"}, {"slots": 5})
    assert got == {"slots": 5, "flag": False}
    assert resolve("x://y", declared, {}, {}) == {"slots": 2, "flag": True}
    with pytest.raises(ss.ConfigError, match="is not true or false"):
        resolve("x://y", declared, {"flag": "maybe"}, {})
    with pytest.raises(ss.ConfigError, match=r"slots=True is not an integer"):
        resolve("x://y", declared, {}, {"slots": True})


async def test_the_memory_fake_takes_the_production_options() -> None:
    url = "memory://opts-production"
    options = {"secret": "s3", "connect_timeout": 5}
    async with (
        open_sender(url, require_all=True, **options) as tx,
        open_receiver(url, **options) as rx,
    ):
        weights = {"w": torch.arange(4.0)}
        got: dict[str, torch.Tensor] = {}

        class Keep:
            def prepare(self) -> None:
                pass

            def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
                got.update((n, t.clone()) for n, t in tensors)

            def finalize(self) -> None:
                pass

        import anyio

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: ss.receive(rx, Keep(), timeout=5))
            await ss.send(weights, tx, timeout=5)
        assert torch.equal(got["w"], weights["w"])


async def test_the_memory_fake_checks_the_secret() -> None:
    url = "memory://opts-secret"
    async with open_sender(url, secret="right") as _:
        with pytest.raises(ss.AuthenticationError, match="another secret"):
            async with open_receiver(url, secret="wrong"):
                pass
    async with (
        open_receiver(url, secret="wrong") as rx,  # waiting before the sender
        open_sender(url, secret="right", connect_timeout=0.2) as tx,
    ):
        with pytest.raises(ss.AuthenticationError, match="another secret"):
            await ss.receive(rx, None, timeout=1)  # type: ignore[arg-type]
        with pytest.raises(ss.SyncTimeoutError, match="0 of 1"):
            await ss.send({"w": torch.ones(1)}, tx, timeout=0.2)


async def test_send_and_receive_name_their_own_keywords_too() -> None:
    with pytest.raises(
        ss.ConfigError,
        match=r"unknown keyword of send\(\) 'bucket_byte' \(did you mean 'bucket_bytes'",
    ) as e:
        await ss.send({"w": torch.ones(1)}, "memory://opts-send", bucket_byte=1024)
    assert "pipeline" in str(e.value) and "slot_bytes" in str(e.value)
    with pytest.raises(ss.ConfigError, match=r"unknown keyword of receive\(\) 'max_tensor_byte'"):
        await ss.receive("memory://opts-send", None, max_tensor_byte=1)  # type: ignore[arg-type]


def test_weight_sync_checks_its_options_when_made() -> None:
    from streamsync.engine.channel import EngineChannel

    with pytest.raises(ss.ConfigError, match=r"unknown keyword of WeightSync\(\) 'slot'"):
        EngineChannel(object(), "shm://opts-ws", slot=3)  # type: ignore[arg-type]
    with pytest.raises(ss.ConfigError, match=r"slots=0; need at least 1"):
        EngineChannel(object(), "shm://opts-ws?slots=0")  # type: ignore[arg-type]


def test_connect_timeout_in_the_url_and_a_keyword_must_agree() -> None:
    # Other options: the keyword wins (above). A bound on waiting given twice and
    # differently is a mistake to name, not one to settle silently.
    url = "memory://opts-agree?connect_timeout=2"
    with pytest.raises(ss.ConfigError, match=r"connect_timeout=3 disagrees with the URL's"):
        open_sender(url, connect_timeout=3)
    with pytest.raises(ss.ConfigError, match=r"connect_timeout=3 disagrees with the URL's"):
        open_receiver(url, connect_timeout=3)
    assert open_sender(url, connect_timeout=2.0).connect_timeout == 2.0  # type: ignore[attr-defined]
    assert open_receiver(url).connect_timeout == 2.0  # type: ignore[attr-defined]


async def test_send_takes_connect_timeout_as_receive_does() -> None:
    # It was passed twice to open_sender (a TypeError) before.
    with pytest.raises(ss.SyncTimeoutError, match=r"0 of 1 receivers joined within 0.1 s"):
        await ss.send({"w": torch.ones(1)}, "memory://opts-nobody", connect_timeout=0.1)
