import pytest
from ucm.core.block_format import (
    HEADER_BYTES,
    BlockFormatError,
    decode_header,
    encode_header,
    verify_payload,
)

KEY = bytes(range(16))
PAYLOAD = bytes(range(256)) * 40


def test_round_trip():
    page = encode_header(KEY, PAYLOAD, b"layout-A")
    assert len(page) == HEADER_BYTES
    header = decode_header(page, expect_key=KEY, expect_layout=b"layout-A")
    assert header.payload_len == len(PAYLOAD) and header.layout == b"layout-A"
    verify_payload(header, PAYLOAD)


@pytest.mark.parametrize("offset", [*range(0, 64), 1000, HEADER_BYTES - 1])
def test_every_flipped_header_byte_is_detected(offset):
    page = bytearray(encode_header(KEY, PAYLOAD, b"layout-A"))
    page[offset] ^= 0x40
    with pytest.raises(BlockFormatError):
        decode_header(page, expect_key=KEY, expect_layout=b"layout-A")


def test_payload_damage_is_detected():
    header = decode_header(encode_header(KEY, PAYLOAD))
    bad = bytearray(PAYLOAD)
    bad[1234] ^= 1
    with pytest.raises(BlockFormatError, match="checksum"):
        verify_payload(header, bad)
    with pytest.raises(BlockFormatError, match="bytes"):
        verify_payload(header, PAYLOAD[:-1])


def test_wrong_key_or_layout_is_detected():
    page = encode_header(KEY, PAYLOAD, b"A")
    with pytest.raises(BlockFormatError, match="key"):
        decode_header(page, expect_key=bytes(16))
    with pytest.raises(BlockFormatError, match="layout"):
        decode_header(page, expect_layout=b"B")


@pytest.mark.parametrize("page", [b"", b"UCMB", bytes(HEADER_BYTES), b"\x89PNG" + bytes(100)])
def test_garbage_is_not_a_header(page):
    with pytest.raises(BlockFormatError):
        decode_header(page)


def test_bad_arguments():
    with pytest.raises(ValueError):
        encode_header(b"short", PAYLOAD)
    with pytest.raises(ValueError):
        encode_header(KEY, PAYLOAD, b"x" * 5000)
