"""Studies over many runs rather than one model: scaling-law fits, teacher-student networks."""
