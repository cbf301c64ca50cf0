//! falcon's C ABI (work in progress).
