"""Methods that fill or skip part of a prompt's cache: RidgeFill (late-layer fill) and SPEED (shallow prefill)."""
