package client

import (
	"errors"
	"testing"
	"time"
)

// TestSpinOption: Options.Spin and CUDAIPC_SPIN map to the polling window
// (0: none), and a CUDAIPC_SPIN that is not a duration is ErrInvalid.
func TestSpinOption(t *testing.T) {
	cases := []struct {
		env  string
		opt  time.Duration
		want time.Duration
	}{
		{"", 0, DefaultSpin},
		{"", -1, 0},
		{"", 7 * time.Microsecond, 7 * time.Microsecond},
		{"0", 7 * time.Microsecond, 0},
		{"-5us", 0, 0},
		{"20us", -1, 20 * time.Microsecond},
	}
	for _, tc := range cases {
		t.Setenv("CUDAIPC_SPIN", tc.env)
		got, err := spinOption(tc.opt)
		if err != nil || got != tc.want {
			t.Errorf("CUDAIPC_SPIN=%q Spin=%v: got %v, %v; want %v", tc.env, tc.opt, got, err, tc.want)
		}
	}
	t.Setenv("CUDAIPC_SPIN", "fast")
	if _, err := spinOption(0); !errors.Is(err, ErrInvalid) {
		t.Errorf("CUDAIPC_SPIN=fast: got %v, want ErrInvalid", err)
	}
}
