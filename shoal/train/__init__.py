"""Pure training math: schedules, the inner optimizer of a stage, the reference trainer loop."""
