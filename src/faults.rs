//! Failure injection for tests (feature `fault-injection`): make the Nth call to a driver entry
//! point return a chosen error without reaching the driver.
//!
//! Every call in [`crate::driver::Api`] passes through this module first, so a test can check that a
//! type stays consistent and leaks nothing when any one driver call fails part-way through an
//! operation.

use crate::driver::sys::CUresult;
use std::sync::Mutex;

struct Fault {
    call: String,
    skip: usize,
    code: CUresult,
}

static PLAN: Mutex<Vec<Fault>> = Mutex::new(Vec::new());

/// Makes the call to `call` that comes after `skip` further successful ones return `code`, once.
pub fn inject(call: &str, skip: usize, code: CUresult) {
    PLAN.lock().unwrap_or_else(|e| e.into_inner()).push(Fault { call: call.to_owned(), skip, code });
}

/// Drops every fault not yet taken; returns how many there were.
pub fn clear() -> usize {
    let mut plan = PLAN.lock().unwrap_or_else(|e| e.into_inner());
    let n = plan.len();
    plan.clear();
    n
}

/// The injected result for this call, if one is due.
pub(crate) fn take(call: &str) -> Option<CUresult> {
    let mut plan = PLAN.lock().unwrap_or_else(|e| e.into_inner());
    let i = plan.iter().position(|f| f.call == call)?;
    if plan[i].skip > 0 {
        plan[i].skip -= 1;
        return None;
    }
    Some(plan.remove(i).code)
}
