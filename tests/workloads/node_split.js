'use strict';
// The Node stack tests' workload (tests/integration/test_node_stacks.py).
//   node node_split.js split SECONDS   run() → cpu_a → work(), cpu_b → work(), again: cpu_a asks
//                                      3x cpu_b's work of the same code (3:1 by
//                                      CPU time, whatever else runs on the host; ~3 ms a round: hot
//                                      enough to be optimized; the tests keep them from being inlined)
//   node node_split.js sort SECONDS    sort_loop() → Array.prototype.sort (a builtin) → by_value()
//   node node_split.js block SECONDS   blocked_here() → Atomics.wait (a builtin calling into C++), 1 s at a time
//   node node_split.js timer SECONDS   nothing but a timer pending (once a second): the event loop waits
// Both print "ready" and end by themselves after SECONDS.
const mode = process.argv[2];
const seconds = Number(process.argv[3] || 120);
const end = Date.now() + seconds * 1000;

const ROUNDS = 10;

function work(rounds, k) {
  let x = 0;
  for (let r = 0; r < rounds; r++) {
    for (let i = 0; i < 20000; i++) x = (x * k + i) | 0;  // LINE_WORK
  }
  return x;
}

function cpu_a() {
  return work(3 * ROUNDS, 31);  // LINE_A
}

function cpu_b() {
  return work(ROUNDS, 17);  // LINE_B
}

function run() {
  let sum = 0;
  while (Date.now() < end) {
    sum += cpu_a();  // CALL_A
    sum += cpu_b();  // CALL_B
  }
  return sum;
}

function by_value(a, b) {
  return a - b;  // LINE_COMPARE
}

function sort_loop() {
  const values = [];
  for (let i = 0; i < 5000; i++) values.push((i * 7919) % 5003);
  while (Date.now() < end) {
    const copy = values.slice();
    copy.sort(by_value);  // CALL_SORT
  }
}

function blocked_here() {
  const cell = new Int32Array(new SharedArrayBuffer(4));
  while (Date.now() < end) Atomics.wait(cell, 0, 0, 1000);  // WAIT_SYNC
}

if (mode === 'split') {
  console.log('ready');
  run();
} else if (mode === 'sort') {
  console.log('ready');
  sort_loop();
} else if (mode === 'block') {
  console.log('ready');
  blocked_here();
} else if (mode === 'timer') {
  console.log('ready');
  const timer = setInterval(function pending_timer() {  // WAIT
    if (Date.now() >= end) clearInterval(timer);
  }, 1000);
} else {
  console.error('usage: node_split.js split|sort|block|timer SECONDS');
  process.exit(2);
}
