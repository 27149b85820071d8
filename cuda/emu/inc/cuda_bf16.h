// Empty on purpose: cuda/emu/emu.h provides the bf16 types.
