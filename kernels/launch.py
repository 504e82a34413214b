"""What the kernels' launch settings share (`DecodeLaunch`, `PrefillLaunch`): warps and
software-pipeline stages as Triton takes them, and checks that name the bad field."""

from .checks import check


def check_tile(name: str, value: int) -> None:
    """Tiles and row counts are powers of two of at least 16 (tl.dot's smallest side)."""
    check(value >= 16 and value & (value - 1) == 0, f"launch.{name}",
          f"must be a power of two of at least 16, got {value}")


class TritonLaunch:
    """Mixin for a frozen dataclass with `num_warps` and `num_stages` (None: Triton's default)."""

    num_warps: int
    num_stages: int | None

    def check_warps_and_stages(self) -> None:
        check(self.num_warps in (1, 2, 4, 8, 16), "launch.num_warps",
              f"must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        check(self.num_stages is None or self.num_stages >= 1, "launch.num_stages",
              f"must be at least 1, got {self.num_stages}")

    def compile_options(self) -> dict:
        """Keyword arguments for a Triton launch."""
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options
