// Package benchq reports latency quantiles from Go benchmarks: p50, p99 and
// the maximum, in milliseconds, by the nearest-rank method.
//
// Nearest rank: the p-quantile of n sorted samples is the ceil(p·n)-th
// smallest. Of 100 samples, p99 is the 99th and the maximum the 100th; an
// index of int(p·n) would have reported the maximum as p99, so a single
// outlier in 100 iterations was the whole p99.
package benchq

import (
	"math"
	"slices"
	"testing"
	"time"
)

// Quantile returns the p-quantile (0 < p ≤ 1) of d by nearest rank, or 0 if
// d is empty. d need not be sorted; it is left as it was.
func Quantile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return at(s, p)
}

func at(sorted []time.Duration, p float64) time.Duration {
	rank := int(math.Ceil(p * float64(len(sorted))))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

// Report reports the p50, p99 and maximum of d as <prefix>p50-ms,
// <prefix>p99-ms and <prefix>max-ms. It reports nothing for no samples.
func Report(b *testing.B, d []time.Duration, prefix string) {
	if len(d) == 0 {
		return
	}
	s := slices.Clone(d)
	slices.Sort(s)
	ms := func(v time.Duration) float64 { return float64(v.Microseconds()) / 1000 }
	b.ReportMetric(ms(at(s, 0.50)), prefix+"p50-ms")
	b.ReportMetric(ms(at(s, 0.99)), prefix+"p99-ms")
	b.ReportMetric(ms(s[len(s)-1]), prefix+"max-ms")
}
