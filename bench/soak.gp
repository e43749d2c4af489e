# soak.gp — the timeline of bench/soak.py: RSS and the p99 request latency over time.
#   gnuplot -e "in='DIR/timeline.csv'; out='DIR/soak.png'; title='...'" bench/soak.gp
set datafile separator ","
set terminal pngcairo size 1000,520 font ",10" noenhanced
set output out
set title title
set xlabel "time (s)"
set ylabel "server RSS (MiB)"
set y2label "p99 latency of requests ended that second (ms)"
set ytics nomirror
set y2tics
set key top left
set grid
plot in using 1:2 skip 1 with lines lw 2 title "RSS (MiB)" axes x1y1, \
     in using 1:4 skip 1 with points pt 7 ps 0.3 title "p99 latency (ms)" axes x1y2, \
     in using 1:3 skip 1 with lines lw 1 title "/health latency (ms)" axes x1y2
