/* Promela twin of the stateright model in model/src/ (issue 3), for a side-by-side throughput
   comparison with SPIN. It encodes the same state as model::State<Machine<Target>> (the
   lifecycle machine's fields plus the world: builds, timers, controller budget, the adapter's
   published binding, the sorted multiset of requests, the published/retired/torn masks, the
   admission budget and emptied mask, and the vacuity bits), and each d_step is one stateright step, so with `spin -o2` (keep write-only
   variables) pan stores exactly the states stateright counts: model/spin/run.sh checks that.

   Bounds (cpp): -DTARGETS=2 -DRETARGETS=4 -DFAILURES=2 -DNREQ=2 -DSHUTDOWN=1 -DADMISSION=1 (the
   standard configuration; ADMISSION is the budget of admission changes, each emptying the
   admission set of one retired binding). Build ids run 1..MAXB with MAXB = RETARGETS + FAILURES (at most 16 here).
   -DBUGGY publishes every finished build (the no-staleness-check mutant): pan must report an
   assertion violation; -DBUGGY_ADMISSION dispatches without checking admission (the
   ignore-admission mutant): pan must report the M10 assertion. Safety properties M1..M8 and M10 are assert()s at the end of every
   step or where the event happens (faults can only arise in the step that causes them); M9 and the V witnesses are not checked here (the comparison is
   about state-space throughput; the Rust model checks them). */

#ifndef TARGETS
#define TARGETS 2
#endif
#ifndef RETARGETS
#define RETARGETS 4
#endif
#ifndef FAILURES
#define FAILURES 2
#endif
#ifndef NREQ
#define NREQ 2
#endif
#ifndef SHUTDOWN
#define SHUTDOWN 1
#endif
#ifndef ADMISSION
#define ADMISSION 1
#endif
#define MAXB (RETARGETS + FAILURES)

#define UNDECIDED 255   /* desired before the first SetTarget */
#define PENDING 0
#define ACTIVE 1
#define UNAVAILABLE 2
#define BIT(i) (1 << (i))

/* ---- the lifecycle machine (prefill_router::lifecycle::Machine) ---- */
byte m_des = UNDECIDED;   /* Undecided / Decided(None)=0 / Decided(Some(t))=t */
byte m_held_id;           /* 0 = nothing held */
byte m_held_t;
byte m_fl_id;             /* 0 = no build in flight */
byte m_fl_t;
byte m_retry;             /* 0 = no retry armed */
byte m_failures;
byte m_next = 1;
bool m_shut;

/* ---- the world ---- */
byte w_des = UNDECIDED;   /* the controller's last decision */
bool w_shut;
byte rleft = RETARGETS;
byte fleft = FAILURES;
bool b_on[MAXB + 1];      /* builds started, not reported, indexed by id */
byte b_t[MAXB + 1];
bool b_c[MAXB + 1];       /* cancelled */
bool b_r[MAXB + 1];       /* started by a retry */
bool t_on[MAXB + 1];      /* timers armed, not fired, indexed by the failed build */
byte t_t[MAXB + 1];
bool t_c[MAXB + 1];
byte cur_id;              /* the adapter's published binding */
byte cur_t;
byte newest;
byte r_stage[NREQ];       /* 0 idle, 1 loaded, 2 running, 3 done; kept sorted by key */
byte r_bid[NREQ];
byte r_bt[NREQ];
byte r_des[NREQ];
int published;
int retired;
int torn;
byte aleft = ADMISSION;   /* admission changes the world may still make */
int emptied;              /* bit i: binding i's admission set is empty */
byte seen;                /* 1 retry active, 2 retired served, 4 stale rejected, 8 reused,
                             16 a request failed on an emptied admission */

/* scratch, not part of the state */
hidden byte h_id, h_t, h_i, h_j, h_life;
hidden byte h_c, h_r, h_started;
hidden int h_k1, h_k2;

#define LIFE(l) \
  if \
  :: m_des == UNDECIDED -> l = PENDING \
  :: m_des == 0 -> l = UNAVAILABLE \
  :: else -> if :: (m_held_id != 0 && m_held_t == m_des) -> l = ACTIVE :: else -> l = PENDING fi \
  fi

/* M1, M3, M8 (state predicates; M2, M4-M7 are asserted where the event happens) */
#define CHECK \
  LIFE(h_life); \
  assert(h_life != ACTIVE || (cur_id != 0 && !w_shut && w_des == cur_t)); \
  h_k1 = 0; h_i = 1; \
  do :: h_i <= MAXB -> if :: (b_on[h_i] && !b_c[h_i]) -> h_k1++; assert(!w_shut && w_des == b_t[h_i]) :: else -> skip fi; h_i++ \
     :: else -> break od; \
  assert(h_k1 <= 1); \
  h_k1 = 0; h_i = 1; \
  do :: h_i <= MAXB -> if :: (t_on[h_i] && !t_c[h_i]) -> h_k1++; assert(!w_shut && w_des == t_t[h_i]) :: else -> skip fi; h_i++ \
     :: else -> break od; \
  assert(h_k1 <= 1); \
  h_i = 0; h_life = 0; h_k1 = 0

/* ---- the adapter carrying out actions ---- */
inline start_build(t, from_retry) {
  h_id = m_next; m_next++;
  m_fl_id = h_id; m_fl_t = t;
  b_on[h_id] = 1; b_t[h_id] = t; b_c[h_id] = 0; b_r[h_id] = from_retry;
  if :: h_id > newest -> newest = h_id :: else -> skip fi;
  h_started = 1
}

inline retire(id) {
  assert((published & BIT(id)) != 0 && (retired & BIT(id)) == 0);   /* M4 */
  retired = retired | BIT(id);
  if :: cur_id == id -> cur_id = 0; cur_t = 0 :: else -> skip fi
}

inline cancel_pending() {
  if
  :: m_fl_id != 0 -> if :: b_on[m_fl_id] -> b_c[m_fl_id] = 1 :: else -> skip fi; m_fl_id = 0; m_fl_t = 0
  :: else -> skip
  fi;
  if
  :: m_retry != 0 -> if :: t_on[m_retry] -> t_c[m_retry] = 1 :: else -> skip fi; m_retry = 0
  :: else -> skip
  fi
}

inline set_target(t) {
  rleft--; w_des = t;
  LIFE(h_life);                 /* lifecycle before, for the "reused" witness */
  h_started = 0;
  if
  :: (m_des != UNDECIDED && m_des == t) -> skip          /* rule 1: same decision */
  :: else ->
     cancel_pending();
     m_failures = 0;
     if
     :: t == 0 -> skip                                  /* rule 2: keep the held binding */
     :: (t != 0 && m_held_id != 0 && m_held_t == t) -> skip   /* rule 3: reuse */
     :: else ->                                         /* rule 4 */
        if :: m_held_id != 0 -> retire(m_held_id); m_held_id = 0; m_held_t = 0 :: else -> skip fi;
        start_build(t, 0)
     fi;
     m_des = t
  fi;
  if
  :: (t != 0 && !h_started && h_life != ACTIVE && m_held_id != 0 && m_held_t == m_des && m_des == t) ->
     seen = seen | 8
  :: else -> skip
  fi;
  h_id = 0; h_started = 0; h_life = 0
}

inline shutdown() {
  rleft--; w_shut = 1;
  cancel_pending();
  if :: m_held_id != 0 -> retire(m_held_id); m_held_id = 0; m_held_t = 0 :: else -> skip fi;
  m_des = 0; m_failures = 0; m_shut = 1
}

inline succeed(i) {
  h_t = b_t[i]; h_c = b_c[i]; h_r = b_r[i];
  b_on[i] = 0; b_t[i] = 0; b_c[i] = 0; b_r[i] = 0;
  if
#ifdef BUGGY
  :: !m_shut ->                                         /* mutant: no staleness check */
     if :: m_fl_id == i -> m_fl_id = 0; m_fl_t = 0 :: else -> skip fi;
     m_held_id = i; m_held_t = h_t; m_failures = 0;
#else
  :: (!m_shut && m_fl_id == i) ->                       /* publish */
     m_held_id = i; m_held_t = m_fl_t; m_fl_id = 0; m_fl_t = 0; m_failures = 0;
#endif
     assert(!h_c && i >= newest);                       /* M2 */
     if :: h_r -> seen = seen | 1 :: else -> skip fi;
     assert((retired & BIT(i)) == 0);                   /* M5 */
     assert(cur_id == 0 || cur_id == i);                /* M4: nothing replaced unretired */
     cur_id = i; cur_t = h_t;
     published = published | BIT(i)
  :: else ->                                            /* discard */
     if
     :: (published & BIT(i)) != 0 -> torn = torn | BIT(i); if :: cur_id == i -> cur_id = 0; cur_t = 0 :: else -> skip fi
     :: else -> seen = seen | 4
     fi
  fi;
  h_t = 0; h_c = 0; h_r = 0
}

inline fail(i) {
  h_t = b_t[i];
  b_on[i] = 0; b_t[i] = 0; b_c[i] = 0; b_r[i] = 0;
  fleft--;
  if
  :: (!m_shut && m_fl_id == i) ->
     m_fl_id = 0; m_fl_t = 0; m_failures++; m_retry = i;
     t_on[i] = 1; t_t[i] = h_t; t_c[i] = 0
  :: else -> skip
  fi;
  h_t = 0
}

inline fire(i) {
  t_on[i] = 0; t_t[i] = 0; t_c[i] = 0;
  if
  :: (!m_shut && m_retry == i) ->
     m_retry = 0;
     if :: (m_des != UNDECIDED && m_des != 0) -> start_build(m_des, 1) :: else -> skip fi
  :: else -> skip
  fi;
  h_id = 0; h_started = 0
}

/* requests: a sorted multiset; key orders them */
#define KEY(q) (r_stage[q] * 16777216 + r_bid[q] * 65536 + r_bt[q] * 256 + r_des[q])

inline sort_requests() {
  h_i = 0;
  do
  :: h_i + 1 < NREQ ->
     h_j = 0;
     do
     :: h_j + 1 < NREQ - h_i ->
        h_k1 = KEY(h_j); h_k2 = KEY(h_j + 1);
        if
        :: h_k1 > h_k2 ->
           h_t = r_stage[h_j]; r_stage[h_j] = r_stage[h_j + 1]; r_stage[h_j + 1] = h_t;
           h_t = r_bid[h_j]; r_bid[h_j] = r_bid[h_j + 1]; r_bid[h_j + 1] = h_t;
           h_t = r_bt[h_j]; r_bt[h_j] = r_bt[h_j + 1]; r_bt[h_j + 1] = h_t;
           h_t = r_des[h_j]; r_des[h_j] = r_des[h_j + 1]; r_des[h_j + 1] = h_t
        :: else -> skip
        fi;
        h_j++
     :: else -> break
     od;
     h_i++
  :: else -> break
  od;
  h_i = 0; h_j = 0; h_t = 0; h_k1 = 0; h_k2 = 0
}

inline load(q) {
  LIFE(h_life);
  r_stage[q] = 1;
  if
  :: h_life == ACTIVE && cur_id != 0 -> r_bid[q] = cur_id; r_bt[q] = cur_t
  :: else -> r_bid[q] = 0; r_bt[q] = 0
  fi;
  if :: w_des == UNDECIDED -> r_des[q] = 0 :: else -> r_des[q] = w_des fi;
  h_life = 0
}

inline dispatch(q) {
  assert((torn & BIT(r_bid[q])) == 0);        /* M7 */
  if
#ifndef BUGGY_ADMISSION
  :: (emptied & BIT(r_bid[q])) != 0 ->        /* no worker in admission: typed failure */
     seen = seen | 16;
     r_stage[q] = 3; r_bid[q] = 0; r_bt[q] = 0; r_des[q] = 0
#endif
  :: else ->                                  /* BUGGY_ADMISSION: dispatch without the check */
     assert((emptied & BIT(r_bid[q])) == 0);  /* M10 */
     assert(r_des[q] == r_bt[q]);             /* M6 */
     r_stage[q] = 2; r_des[q] = 0
  fi
}

inline empty_admission(i) {
  aleft--; emptied = emptied | BIT(i)
}

inline bypass(q) {
  r_stage[q] = 3; r_bid[q] = 0; r_bt[q] = 0; r_des[q] = 0
}

inline finish(q) {
  assert((torn & BIT(r_bid[q])) == 0);        /* M7 */
  if :: (retired & BIT(r_bid[q])) != 0 -> seen = seen | 2 :: else -> skip fi;
  r_stage[q] = 3; r_bid[q] = 0; r_bt[q] = 0; r_des[q] = 0
}

#define TARGET_STEP(t) \
  :: d_step { (!w_shut && rleft > 0) -> set_target(t); CHECK }

#define BUILD_STEPS(i) \
  :: d_step { b_on[i] -> succeed(i); CHECK } \
  :: d_step { (b_on[i] && fleft > 0) -> fail(i); CHECK } \
  :: d_step { t_on[i] -> fire(i); CHECK } \
  :: d_step { (aleft > 0 && (retired & BIT(i)) != 0 && (emptied & BIT(i)) == 0) -> empty_admission(i); CHECK }

#define REQUEST_STEPS(q) \
  :: d_step { r_stage[q] == 0 -> load(q); sort_requests(); CHECK } \
  :: d_step { (r_stage[q] == 1 && r_bid[q] != 0) -> dispatch(q); sort_requests(); CHECK } \
  :: d_step { (r_stage[q] == 1 && r_bid[q] == 0) -> bypass(q); sort_requests(); CHECK } \
  :: d_step { r_stage[q] == 2 -> finish(q); sort_requests(); CHECK }

active proctype world() {
end:
  do
  TARGET_STEP(0)
  TARGET_STEP(1)
#if TARGETS >= 2
  TARGET_STEP(2)
#endif
#if TARGETS >= 3
  TARGET_STEP(3)
#endif
#if SHUTDOWN
  :: d_step { (!w_shut && rleft > 0) -> shutdown(); CHECK }
#endif
  BUILD_STEPS(1)
#if MAXB >= 2
  BUILD_STEPS(2)
#endif
#if MAXB >= 3
  BUILD_STEPS(3)
#endif
#if MAXB >= 4
  BUILD_STEPS(4)
#endif
#if MAXB >= 5
  BUILD_STEPS(5)
#endif
#if MAXB >= 6
  BUILD_STEPS(6)
#endif
#if MAXB >= 7
  BUILD_STEPS(7)
#endif
#if MAXB >= 8
  BUILD_STEPS(8)
#endif
#if MAXB >= 9
  BUILD_STEPS(9)
#endif
#if MAXB >= 10
  BUILD_STEPS(10)
#endif
#if MAXB >= 11
  BUILD_STEPS(11)
#endif
#if MAXB >= 12
  BUILD_STEPS(12)
#endif
#if MAXB >= 13
  BUILD_STEPS(13)
#endif
#if MAXB >= 14
  BUILD_STEPS(14)
#endif
#if MAXB >= 15
  BUILD_STEPS(15)
#endif
#if MAXB >= 16
  BUILD_STEPS(16)
#endif
  REQUEST_STEPS(0)
#if NREQ >= 2
  REQUEST_STEPS(1)
#endif
#if NREQ >= 3
  REQUEST_STEPS(2)
#endif
#if NREQ >= 4
  REQUEST_STEPS(3)
#endif
  od
}
