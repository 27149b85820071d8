// Empty on purpose: cuda/emu/emu.h provides the f16 type.
