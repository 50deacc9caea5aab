// Package bytesize parses and prints byte counts with binary (IEC) units:
// the one definition of sizes on the command line and in reports.
package bytesize

import (
	"fmt"
	"strconv"
	"strings"
)

// Size is a byte count that flags accept with a unit suffix: 4096, 64KiB,
// 16MiB, 1GiB, 1G (powers of 1024 either way).
type Size int64

// UnmarshalText parses text with Parse.
func (s *Size) UnmarshalText(text []byte) error {
	n, err := Parse(string(text))
	if err != nil {
		return err
	}
	*s = Size(n)
	return nil
}

// MarshalText prints s exactly, in the largest binary unit that divides it
// (1GiB, 1536KiB, 4097), so that UnmarshalText reads back the same count.
func (s Size) MarshalText() ([]byte, error) {
	n := int64(s)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n != 0 && n%u.mult == 0 {
			return []byte(strconv.FormatInt(n/u.mult, 10) + u.suffix), nil
		}
	}
	return []byte(strconv.FormatInt(n, 10)), nil
}

// String formats s with Format.
func (s Size) String() string { return Format(int64(s)) }

var suffixes = []struct {
	suffix string
	mult   int64
}{
	{"tib", 1 << 40}, {"gib", 1 << 30}, {"mib", 1 << 20}, {"kib", 1 << 10},
	{"tb", 1 << 40}, {"gb", 1 << 30}, {"mb", 1 << 20}, {"kb", 1 << 10},
	{"t", 1 << 40}, {"g", 1 << 30}, {"m", 1 << 20}, {"k", 1 << 10}, {"b", 1},
}

// Parse reads a byte count with an optional unit: 4096, 64KiB, 16 MiB, 1G.
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	lower := strings.ToLower(t)
	for _, u := range suffixes {
		if strings.HasSuffix(lower, u.suffix) {
			mult = u.mult
			t = strings.TrimSpace(t[:len(t)-len(u.suffix)])
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad size %q: want a byte count such as 4096, 64KiB, 16MiB or 1GiB", s)
	}
	if n > (1<<62)/mult {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return n * mult, nil
}

// Format prints n in the largest binary unit it reaches: "64 MiB" for a
// whole number of units, else one decimal ("1.5 MiB"); "1000 B" below
// 1 KiB.
func Format(n int64) string {
	const units = "KMGTP"
	if n < 1<<10 && n > -1<<10 {
		return strconv.FormatInt(n, 10) + " B"
	}
	exp := 0
	for exp < len(units)-1 && (n>>(10*(exp+2)) != 0) {
		exp++
	}
	div := int64(1) << (10 * (exp + 1))
	if n%div == 0 {
		return fmt.Sprintf("%d %ciB", n/div, units[exp])
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), units[exp])
}
