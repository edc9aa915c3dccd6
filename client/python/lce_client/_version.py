"""The package's version: the project's (CMakeLists.txt, project(VERSION); a test keeps them equal)."""
VERSION = "0.1.0"


def major(version: str) -> str:
    """The major part of a version string ("0.1.0" -> "0"; "" for none)."""
    return version.split(".", 1)[0].strip() if version else ""
