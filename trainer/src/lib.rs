//! falcon-trainer drives compute on top of the engine: models on flat f32 buffers, data,
//! the elastic thread pool, straggler projection, the parallelism manager and task transfer
//! (issue 6). It talks to the parameter server only through `falcon_engine::Worker`, and must
//! not know about media, regions' wire formats or how policies decide.
//!
//! Not built yet: this crate is an empty shell so the workspace has its final shape.
