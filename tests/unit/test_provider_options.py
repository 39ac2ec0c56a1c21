"""A route's provider options: read by its provider only, refused by name when it takes none, and the
scripted provider's usage ratio, which used to be a route field, still decodes from recorded histories."""

from __future__ import annotations

import pytest

from activities.openai_provider import UnconfiguredProvider
from activities.provider import ProviderRequest, ProviderSegment, ScriptedProvider
from contract.payloads import ModelRoute
from core.estimator import ModelProfile


def _request(options: dict[str, float]) -> ProviderRequest:
    segment = ProviderSegment(
        raw_tokens=100, role="user", kind="current_message", trust="USER", region="B", text="hi", item_id="u:1"
    )
    return ProviderRequest(
        session_id="s",
        epoch=1,
        provider="scripted",
        model="scripted-1",
        prefix_sha256="p",
        request_sha256="r",
        segments=[segment],
        options=options,
    )


class TestModelRoute:
    def test_recorded_default_ratio_decodes_to_no_options(self) -> None:
        """A route recorded with `scripted_usage_ratio: 1.0` (every history in tests/histories) decodes to the
        same route without options."""
        recorded = ModelRoute.model_validate({"provider": "scripted", "scripted_usage_ratio": 1.0})
        assert recorded == ModelRoute(provider="scripted")

    def test_recorded_ratio_becomes_the_scripted_option(self) -> None:
        """Any other recorded ratio becomes the scripted provider's `usage_ratio` option."""
        recorded = ModelRoute.model_validate({"model": "m", "scripted_usage_ratio": 1.3})
        assert recorded.provider_options == {"usage_ratio": 1.3}

    def test_the_route_carries_no_provider_specific_field(self) -> None:
        """The contract's route names no option of any one provider."""
        assert not [f for f in ModelRoute.model_fields if f.startswith("scripted")]


class TestScriptedOptions:
    def test_usage_ratio_is_the_calibration_floor(self) -> None:
        """A route whose usage ratio is above its calibration starts calibrated at that ratio, never below."""
        provider = ScriptedProvider()
        profile = ModelRoute().profile()
        assert provider.route_profile(profile, {"usage_ratio": 1.4}).calibration == 1.4
        assert provider.route_profile(profile, {}).calibration == profile.calibration

    @pytest.mark.parametrize("name, value", [("usage_ratio", 0), ("usage_ration", 1.2)])
    def test_a_bad_or_unknown_option_is_refused(self, name: str, value: float) -> None:
        """A ratio that is not positive, and an option the scripted provider does not take, are refused by name."""
        with pytest.raises(ValueError, match=name):
            ScriptedProvider().route_profile(ModelProfile(), {name: value})

    async def test_usage_is_counted_times_the_ratio(self) -> None:
        """The reported input usage scales with the request's `usage_ratio` option."""
        plain = await ScriptedProvider().complete(_request({}))
        scaled = await ScriptedProvider().complete(_request({"usage_ratio": 2.0}))
        assert scaled.usage.input_tokens == 2 * plain.usage.input_tokens


def test_a_provider_without_options_refuses_any_by_name() -> None:
    """A real adapter (here, its stand-in without a key) takes no options and names the one it was given."""
    provider = UnconfiguredProvider("openai", "set OPENAI_API_KEY")
    with pytest.raises(ValueError, match="takes no options; got usage_ratio"):
        provider.route_profile(ModelProfile(), {"usage_ratio": 2.0})
    assert provider.route_profile(ModelProfile(), {}) == ModelProfile()
