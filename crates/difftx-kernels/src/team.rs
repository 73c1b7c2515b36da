//! A team of hot helper threads for the decode step's splits.
//!
//! One decode step at batch 1 splits some 25 small products (tens of microseconds each) across
//! the cores. Through rayon each split hands half the work to a worker that has often gone to
//! sleep since the last one: waking it is a futex call and, in a virtual machine, an
//! inter-processor interrupt. On the 2-core Xeon of docs/design.md §7.13 a third of a decode
//! step's perf samples were the kernel's scheduler, and one thread decoded faster than two. The
//! helpers here spin (`spin_loop`) for [`SPIN_BEFORE_PARK`] after each job before they park, so a
//! step's splits, and the next token's, find them awake: one wake-up per burst instead of one per
//! split. rayon's idle workers give up sooner (a few dozen `sched_yield`s) and its sleep is not
//! configurable.
//!
//! [`for_each_mut`] is the one entry point: `f(i, &mut items[i])` for every item, the calling
//! thread taking its share. One caller at a time uses the helpers; a second caller (or a job that
//! splits again from inside a helper) runs its items on its own thread, so nothing can deadlock.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long a helper keeps spinning for its next job before it parks: longer than the gaps
/// between one decode step's splits and between its tokens, short enough that a finished decode
/// leaves no core busy for long.
pub const SPIN_BEFORE_PARK: Duration = Duration::from_millis(1);

const IDLE: u8 = 0;
const POSTED: u8 = 1;
const DONE: u8 = 2;

/// One participant's share of a call: `share(data, participant, participants)` runs the items
/// `participant`, `participant + participants`, ...
#[derive(Clone, Copy)]
struct Job {
    data: *const (),
    share: unsafe fn(*const (), usize, usize),
    participant: usize,
    participants: usize,
}

impl Job {
    /// # Safety
    /// `data` must still be what `share` expects (the caller of `for_each_mut_init` waits for
    /// this).
    unsafe fn run(&self) {
        // SAFETY: the contract of this function.
        unsafe { (self.share)(self.data, self.participant, self.participants) };
    }
}

/// One helper's mailbox.
struct Slot {
    state: AtomicU8,
    /// Written by the caller before `state` becomes POSTED, read by the helper after it sees
    /// POSTED (Release / Acquire on `state` orders the two).
    job: UnsafeCell<Option<Job>>,
    /// A panic of the helper's share, handed to the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    parked: AtomicBool,
}

// SAFETY: `job` is only written by the one caller that holds the team (`Team::busy`) while the
// slot is IDLE and only read by the helper while it is POSTED; `state` orders the two. The job's
// pointers are only followed while that caller waits for the helper.
unsafe impl Sync for Slot {}
// SAFETY: as for Sync.
unsafe impl Send for Slot {}

struct Helper {
    slot: Arc<Slot>,
    thread: Thread,
}

struct Team {
    helpers: Vec<Helper>,
    busy: AtomicBool,
}

/// The team, made on first use: as many participants as the rayon pool of the thread that first
/// uses it has threads (`RAYON_NUM_THREADS` or the cores for the global pool), the caller being
/// one of them.
fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let helpers = (1..rayon::current_num_threads().max(1))
            .filter_map(|n| {
                let slot = Arc::new(Slot {
                    state: AtomicU8::new(IDLE),
                    job: UnsafeCell::new(None),
                    panic: Mutex::new(None),
                    parked: AtomicBool::new(false),
                });
                let mine = Arc::clone(&slot);
                // A helper that cannot be started leaves its share to the others.
                let handle =
                    thread::Builder::new().name(format!("difftx-team-{n}")).spawn(move || serve(&mine)).ok()?;
                Some(Helper { slot, thread: handle.thread().clone() })
            })
            .collect();
        Team { helpers, busy: AtomicBool::new(false) }
    })
}

/// A helper's loop: spin for a job, park when none came for `SPIN_BEFORE_PARK`, run it, repeat.
fn serve(slot: &Slot) {
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        while slot.state.load(Ordering::Acquire) != POSTED {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            if since.elapsed() < SPIN_BEFORE_PARK {
                continue;
            }
            // SeqCst on `parked` and `state` here and in `post`: either the caller sees
            // `parked` and unparks, or this thread sees POSTED and does not park.
            slot.parked.store(true, Ordering::SeqCst);
            if slot.state.load(Ordering::SeqCst) != POSTED {
                thread::park();
            }
            slot.parked.store(false, Ordering::SeqCst);
            since = Instant::now();
        }
        // SAFETY: POSTED means the caller wrote the job and waits for DONE before its data goes.
        let job = unsafe { (*slot.job.get()).expect("a posted slot holds a job") };
        // SAFETY: as above.
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { job.run() })) {
            *slot.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(payload);
        }
        slot.state.store(DONE, Ordering::Release);
    }
}

/// Releases the team when the call ends, after waiting for every helper it posted to (also
/// when the caller's own share panics: the helpers still read the caller's data until DONE).
struct Posted<'a> {
    team: &'a Team,
    helpers: usize,
}

impl Posted<'_> {
    /// Waits for the posted helpers and returns the first helper panic, if any.
    fn wait(&mut self) -> Option<Box<dyn Any + Send>> {
        let mut panic = None;
        for h in &self.team.helpers[..self.helpers] {
            while h.slot.state.load(Ordering::Acquire) != DONE {
                std::hint::spin_loop();
            }
            let p = h.slot.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
            panic = panic.or(p);
            h.slot.state.store(IDLE, Ordering::Relaxed);
        }
        self.helpers = 0;
        panic
    }
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        self.wait();
        self.team.busy.store(false, Ordering::Release);
    }
}

/// Number of threads [`for_each_mut`] spreads items over (the caller included).
pub fn participants() -> usize {
    team().helpers.len() + 1
}

/// Calls `f(i, &mut items[i])` for every item, spread over the caller and the helpers: item `i`
/// goes to participant `i % participants()`, the caller being participant 0. Returns when all
/// are done; a panic in any call is raised here. When the helpers are taken (another caller, or
/// a call from inside `f`), every item runs on the calling thread, in order.
pub fn for_each_mut<T: Send, F: Fn(usize, &mut T) + Sync>(items: &mut [T], f: F) {
    for_each_mut_init(items, || (), |_, i, item| f(i, item))
}

/// [`for_each_mut`] with a state per participant: each thread that takes part calls `init` once
/// and hands its state to `f` for each of its items (scratch buffers made once per thread, not
/// per item).
pub fn for_each_mut_init<T, S, I, F>(items: &mut [T], init: I, f: F)
where
    T: Send,
    I: Fn() -> S + Sync,
    F: Fn(&mut S, usize, &mut T) + Sync,
{
    let team = team();
    let n = items.len();
    let helpers = team.helpers.len().min(n.saturating_sub(1));
    if helpers == 0 || team.busy.swap(true, Ordering::Acquire) {
        let mut state = init();
        items.iter_mut().enumerate().for_each(|(i, item)| f(&mut state, i, item));
        return;
    }
    struct Shared<T, I, F> {
        items: *mut T,
        len: usize,
        init: I,
        f: F,
    }
    /// # Safety
    /// `data` points to a live `Shared<T, I, F>` and no other call gets the same `participant`.
    unsafe fn share<T, S, I: Fn() -> S, F: Fn(&mut S, usize, &mut T)>(
        data: *const (),
        participant: usize,
        participants: usize,
    ) {
        // SAFETY: the contract of this function; participant p takes the items p, p + n, ..., so
        // no index is handed out twice and `&mut *items.add(i)` is unique.
        unsafe {
            let shared = &*(data as *const Shared<T, I, F>);
            let mut state = (shared.init)();
            for i in (participant..shared.len).step_by(participants) {
                (shared.f)(&mut state, i, &mut *shared.items.add(i));
            }
        }
    }
    let shared = Shared { items: items.as_mut_ptr(), len: n, init, f };
    let job = |participant| Job {
        data: &shared as *const Shared<T, I, F> as *const (),
        share: share::<T, S, I, F>,
        participant,
        participants: helpers + 1,
    };
    let mut posted = Posted { team, helpers };
    for (h, helper) in team.helpers[..helpers].iter().enumerate() {
        // SAFETY: this caller holds the team and the slot is IDLE, so the helper does not read it.
        unsafe { *helper.slot.job.get() = Some(job(h + 1)) };
        helper.slot.state.store(POSTED, Ordering::SeqCst);
        if helper.slot.parked.load(Ordering::SeqCst) {
            helper.thread.unpark();
        }
    }
    // SAFETY: `shared` lives until `posted` has waited for every helper (also on unwinding).
    unsafe { job(0).run() };
    if let Some(payload) = posted.wait() {
        drop(posted);
        resume_unwind(payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_once_in_place() {
        for n in [0, 1, 2, 3, 7, 64] {
            let mut items: Vec<Vec<usize>> = vec![Vec::new(); n];
            for_each_mut(&mut items, |i, item| item.push(i * 10));
            assert_eq!(items, (0..n).map(|i| vec![i * 10]).collect::<Vec<_>>());
        }
    }

    #[test]
    fn each_participant_makes_one_state() {
        use std::sync::atomic::AtomicUsize;
        let inits = AtomicUsize::new(0);
        let mut items = vec![0usize; 40];
        for_each_mut_init(
            &mut items,
            || {
                inits.fetch_add(1, Ordering::Relaxed);
                0usize
            },
            |seen, i, item| {
                *seen += 1;
                *item = i * 1000 + *seen;
            },
        );
        let made = inits.load(Ordering::Relaxed);
        assert!((1..=participants()).contains(&made), "{made} states for {} participants", participants());
        // Item i is its participant's (i / made + 1)-th when the items were dealt over `made`.
        for (i, v) in items.iter().enumerate() {
            assert_eq!(*v, i * 1000 + i / made + 1, "item {i}");
        }
    }

    #[test]
    fn nested_calls_run_inline() {
        let mut outer = vec![vec![0u32; 5]; 4];
        for_each_mut(&mut outer, |i, inner| for_each_mut(inner, |j, v| *v = (i * 100 + j) as u32));
        for (i, inner) in outer.iter().enumerate() {
            assert_eq!(*inner, (0..5).map(|j| (i * 100 + j) as u32).collect::<Vec<_>>());
        }
    }

    #[test]
    fn many_callers_at_once() {
        let sums: Vec<u64> = (0..8u64)
            .map(|t| {
                thread::spawn(move || {
                    let mut total = 0;
                    for _ in 0..200 {
                        let mut items: Vec<u64> = (0..9).collect();
                        for_each_mut(&mut items, |i, v| *v += t * i as u64);
                        total += items.iter().sum::<u64>();
                    }
                    total
                })
            })
            .map(|h| h.join().unwrap())
            .collect();
        for (t, s) in sums.iter().enumerate() {
            assert_eq!(*s, 200 * (36 + t as u64 * 36));
        }
    }

    #[test]
    fn a_panic_reaches_the_caller_and_the_team_recovers() {
        for bad in [0, 1] {
            let result = catch_unwind(|| {
                let mut items = vec![0u8; 2];
                for_each_mut(&mut items, |i, _| assert!(i != bad, "item {i} fails"));
            });
            assert!(result.is_err(), "item {bad}'s panic was lost");
        }
        let mut items = vec![1u32; 6];
        for_each_mut(&mut items, |i, v| *v += i as u32);
        assert_eq!(items, vec![1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn helpers_park_and_wake() {
        let mut items = vec![0u8; 2];
        for_each_mut(&mut items, |_, v| *v += 1);
        thread::sleep(SPIN_BEFORE_PARK * 5);
        for_each_mut(&mut items, |_, v| *v += 1);
        assert_eq!(items, vec![2, 2]);
    }
}
