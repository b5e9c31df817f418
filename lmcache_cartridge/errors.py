"""Exceptions. Each message says what is wrong and what the user can do about it."""


class CartridgeError(Exception):
    """Base class: anything that stops a cartridge from being packed, registered or served."""


class CartridgeFormatError(CartridgeError):
    """An input file is not a cartridge we can read (bad structure, unsafe pickle, bad shapes)."""


class ManifestError(CartridgeError):
    """A packed cartridge's manifest is missing, malformed, or inconsistent with its payload."""


class ChecksumError(CartridgeError):
    """Payload bytes do not match the checksum recorded in the manifest."""


class IncompatibleCartridgeError(CartridgeError):
    """The cartridge was made for another model, dtype, layout or chunk size than the engine's."""


class KeyConfigError(CartridgeError):
    """LMCache's configuration would make scheduler and workers compute different chunk keys."""
