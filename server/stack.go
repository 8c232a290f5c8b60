package server

import "net/http"

// A request's handler runs on a goroutine HTTP/2 starts for it, with the
// runtime's smallest stack (2 KiB). Connect, the interceptors and a sandbox
// operation go some 20 KiB deep, so the stack would grow four times per RPC
// (doubling from 2 KiB), each growth copying a deeper stack and adjusting
// every frame of it: a measurable share of the server's CPU under the
// rollback load test. growStacks grows it once, at the top, where there are
// few frames to adjust.

// handlerStackBytes is the stack a handler gets before it runs: the frame
// of growStack, which the runtime rounds up to the next power of two with
// what is already on the stack (32 KiB).
const handlerStackBytes = 20 << 10

func growStacks(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		growStack()
		next.ServeHTTP(w, r)
	})
}

// growStack has a frame of handlerStackBytes; calling it makes the stack at
// least that large.
//
//go:noinline
func growStack() {
	var frame [handlerStackBytes]byte
	touch(&frame)
}

//go:noinline
func touch(*[handlerStackBytes]byte) {}
