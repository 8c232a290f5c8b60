// Package securitytest is the security suite (make test-security): attacks run as an agent
// would run them — commands and file actions in a sandbox, through the real API of an
// in-process server on a loopback port — each asserting the refusal (an errno, a signal, or
// state left unchanged) and that a canary sandbox of the same server still answers a Step within
// a generous multiple of the latency measured before the attack. docs/SECURITY.md is the threat
// model the attacks stand for.
//
// A family of attacks is one test function (TestAttack<Family>) that starts with begin(t); a
// case that only checks a system call's answer is a row of a syscallCase table. The package has
// no code of its own outside its tests.
package securitytest
